"""A tree-mask twin of a bundle for side-by-side benchmarks, without copying its weights.

    .venv/bin/python bench/tree_twin.py models/default models/default-tree

Copies the small files of SRC (manifest, tokenizers, graph protos) into DST, links the
large external-data files (the weights) instead of copying them (hard links: same
filesystem), and upgrades DST in place
with `spectr-edge export --add-tree-mask` (export/tree_mask.py), which checks the new graphs
against the originals. SRC is not modified. Run `bench/run.py --suite tree --bundle SRC
--tree-bundle DST` to compare replicated and trie verification on the same weights.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from export.tree_mask import add_tree_mask_to_bundle  # noqa: E402

LINK_ABOVE = 64 * 2**20   # files larger than this are linked, not copied


def main(src: str, dst: str) -> None:
    src_dir, dst_dir = Path(src).resolve(), Path(dst)
    if dst_dir.exists():
        raise SystemExit(f"error: {dst_dir} exists; remove it first")
    for f in sorted(src_dir.rglob("*")):
        target = dst_dir / f.relative_to(src_dir)
        if f.is_dir():
            target.mkdir(parents=True, exist_ok=True)
        elif f.stat().st_size > LINK_ABOVE:   # a hard link: ONNX Runtime refuses external data outside
            target.parent.mkdir(parents=True, exist_ok=True)   # the model's folder, symlinks included
            os.link(f, target)
        else:
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(f, target)
    changed = add_tree_mask_to_bundle(dst_dir)
    print(f"{dst_dir}: {', '.join(changed)} take a tree mask; weights linked from {src_dir}")


if __name__ == "__main__":
    if len(sys.argv) != 3:
        raise SystemExit(__doc__)
    main(sys.argv[1], sys.argv[2])
