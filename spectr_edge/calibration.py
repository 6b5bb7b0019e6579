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
    # translation
    "Translate into French: The meeting has been moved to Thursday afternoon because two of the "
    "speakers could not travel on Tuesday.",
)
