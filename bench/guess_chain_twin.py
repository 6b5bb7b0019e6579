"""A twin of a bundle whose guess head drafts one guess per step: the same graphs and weights, the
guess head's chain graph left out of the manifest (and the folder).

    .venv/bin/python bench/guess_chain_twin.py models/default-int4 models/default-int4-one-guess

Hard-links SRC's weights into DST and writes DST's manifest without `guess_chain` and the
`guess_state` output, so `bench/run.py --suite guess-chain` measures the chain side by side with
the same head's first guess alone. SRC is not modified.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from spectr_edge.bundle import write_manifest  # noqa: E402
from harness import new_twin  # noqa: E402


def main(src: str, dst: str) -> None:
    manifest = json.loads((Path(src) / "spectr.json").read_text())
    target = manifest["models"]["target"]
    chain = target.pop("guess_chain", None)
    if chain is None:
        raise SystemExit(f"error: {src} has no guess chain (spectr-edge export --add-guess-head --out {src})")
    src_dir, dst_dir = new_twin(src, dst, skip={(Path(src) / chain).resolve()})
    target["outputs"].pop("guess_state", None)
    manifest["guess_head"].pop("chain", None)
    manifest["name"] = f"{manifest.get('name', src_dir.name)}-one-guess"
    write_manifest(dst_dir, manifest)
    print(f"{dst_dir}: the guess head's first guess only; weights linked from {src_dir}")


if __name__ == "__main__":
    if len(sys.argv) != 3:
        raise SystemExit(__doc__)
    main(sys.argv[1], sys.argv[2])
