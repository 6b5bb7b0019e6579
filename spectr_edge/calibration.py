"""Calibration prompts for `spectr-edge tune`: one per kind of request a user sends.

Written for this project (not taken from Spec-Bench or any benchmark set, so tuning never sees
a benchmark prompt). The mix matters: prompt lookup pays on requests that quote their input
(summaries, questions over a passage, code edits); a draft model pays on free text and code.
"""

CALIBRATION_PROMPTS = (
    # code
    "Write a Python function `merge_intervals(intervals)` that merges overlapping closed intervals "
    "given as a list of (start, end) tuples, and add a short docstring.",
    # open-ended writing / chat
    "Give me three tips for keeping a small vegetable garden healthy through a hot, dry summer.",
    # summarization of a given passage
    "Summarize the following note in two sentences.\n\n"
    "The maintenance window for the billing service moves from Saturday night to Sunday morning, "
    "starting next month. During the window the service stops accepting new invoices, but payments "
    "that are already queued are still processed. Teams that run nightly batch jobs against the "
    "billing API should move those jobs outside the new window or make them retry after 10:00. The "
    "operations team will post a reminder in the usual channel one day before each window, and the "
    "status page will show the window as planned maintenance.",
    # question answering over a given context (RAG-like)
    "Answer the question using only the context.\n\nContext: The Lindqvist bridge opened in 1968 and "
    "carries two road lanes and one rail track across the fjord. It was closed for repairs in 1994 and "
    "again in 2011, when the rail track was replaced. Its main span is 412 metres long.\n\n"
    "Question: When was the rail track of the Lindqvist bridge replaced, and how long is its main span?",
    # arithmetic reasoning
    "A train leaves at 09:40 and travels 186 km at an average speed of 62 km/h. It then waits 15 minutes "
    "and travels another 45 km at 90 km/h. At what time does it arrive? Explain step by step.",
    # a long document with a request about it (~520 tokens): the draft's prefill and copying matter
    "Read the design note below and list the three changes it proposes, each with its reason, in a few "
    "bullet points.\n\n"
    "Design note: moving the photo archive to tiered storage\n\n"
    "Background. The family photo archive has grown to about 2.3 terabytes over twelve years. All of it "
    "lives on a single network drive in the study, which is backed up every night to a second drive in "
    "the same room. Most of the files are never opened after the first month: the log of the file server "
    "shows that 94 percent of the reads in the last year touched photos taken in the previous six weeks. "
    "The drive is now 88 percent full, the nightly backup takes more than five hours, and both drives are "
    "in the same room, so a fire or a burst pipe would destroy the archive and its only copy at once.\n\n"
    "Proposal one: split the archive into a hot tier and a cold tier. Photos from the last ninety days "
    "stay on the network drive, where the phones upload them and where the photo frame in the kitchen "
    "reads them. Everything older moves once a month to the cold tier, a pair of large external disks "
    "that are only connected for the move and for restores. This frees about 2.1 terabytes on the network "
    "drive and shortens the nightly backup to a few minutes, because only the hot tier changes.\n\n"
    "Proposal two: keep one copy of the cold tier somewhere else. One of the two external disks is kept "
    "at a relative's house and swapped with the other one every three months. In the worst case the "
    "archive then loses the photos of one quarter, and those are still on the phones and in the hot tier "
    "for the first ninety days.\n\n"
    "Proposal three: check the copies instead of trusting them. Every move to the cold tier writes a list "
    "of checksums, and a small script compares both external disks against that list when they are "
    "swapped. A disk that reports errors or a mismatch is replaced before the next swap, and the list "
    "itself is kept on both disks and on the network drive.\n\n"
    "Costs and open questions. Two 4-terabyte external disks cost about as much as one year of the cloud "
    "plan that was considered last winter, and they last longer. The open questions are who does the "
    "monthly move when the household is travelling, and whether the photo frame should also show a "
    "random selection from the cold tier, which would need the disks to be connected more often.",
    # translation
    "Translate into French: The meeting has been moved to Thursday afternoon because two of the "
    "speakers could not travel on Tuesday.",
)
