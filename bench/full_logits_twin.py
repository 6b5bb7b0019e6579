"""A twin of a bundle whose graphs compute every position's logits (as exports before 2026-12-02).

    .venv/bin/python bench/full_logits_twin.py models/default models/default-full-logits

Copies SRC's small files (manifest, tokenizers, graph protos) into DST, hard-links the weights,
and removes the `logits_keep` input from DST's graphs (export/logits_keep.py), so
`bench/run.py --suite prefill` measures the prefill's LM head on the same weights side by side.
SRC is not modified.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from spectr_edge_export.logits_keep import rewrite_graph  # noqa: E402
from spectr_edge.bundle import write_manifest  # noqa: E402
from harness import new_twin  # noqa: E402


def main(src: str, dst: str) -> None:
    src_dir, dst_dir = new_twin(src, dst)
    manifest = json.loads((dst_dir / "spectr.json").read_text())
    for entry in manifest["models"].values():
        graph = dst_dir / entry["file"]
        rewrite_graph(graph, graph, remove=True)       # a new file (os.replace): SRC's stays as it is
        entry["inputs"].pop("logits_keep", None)
    manifest["name"] = f"{manifest.get('name', src_dir.name)}-full-logits"
    write_manifest(dst_dir, manifest)
    print(f"{dst_dir}: every position's logits; weights linked from {src_dir}")


if __name__ == "__main__":
    if len(sys.argv) != 3:
        raise SystemExit(__doc__)
    main(sys.argv[1], sys.argv[2])
