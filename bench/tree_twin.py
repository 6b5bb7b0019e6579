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

from spectr_edge_export.tree_mask import add_tree_mask_to_bundle  # noqa: E402

LINK_ABOVE = 64 * 2**20   # files larger than this are linked, not copied


def link_or_copy(src_dir: Path, dst_dir: Path, skip=frozenset()) -> None:
    """Recreate src_dir's files under dst_dir: large ones hard-linked (ONNX Runtime refuses external
    data outside the model's folder, symlinks included), small ones copied; `skip`: resolved paths."""
    for f in sorted(src_dir.rglob("*")):
        if f.is_dir() or f.resolve() in skip:
            continue
        target = dst_dir / f.relative_to(src_dir)
        target.parent.mkdir(parents=True, exist_ok=True)
        (os.link if f.stat().st_size > LINK_ABOVE else shutil.copy2)(f, target)


def main(src: str, dst: str) -> None:
    src_dir, dst_dir = Path(src).resolve(), Path(dst)
    if dst_dir.exists():
        raise SystemExit(f"error: {dst_dir} exists; remove it first")
    link_or_copy(src_dir, dst_dir)
    changed = add_tree_mask_to_bundle(dst_dir)
    print(f"{dst_dir}: {', '.join(changed)} take a tree mask; weights linked from {src_dir}")


if __name__ == "__main__":
    if len(sys.argv) != 3:
        raise SystemExit(__doc__)
    main(sys.argv[1], sys.argv[2])
