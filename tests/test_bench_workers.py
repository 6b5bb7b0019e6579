"""bench/run.py's worker processes: a worker that dies says why, and what to do about it."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import run  # noqa: E402

SEGFAULT = "import os, signal; os.kill(os.getpid(), signal.SIGSEGV)"


def _python_in(venv: Path) -> str:
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").symlink_to(sys.executable)
    return str(venv / "bin" / "python")


@pytest.mark.parametrize("venv, flags, hint", [
    (".venv-llamacpp", ["avx2", "avx512f", "amx_int8"], True),     # the native build on a CPU with AMX
    (".venv-llamacpp", ["avx2", "avx512f"], False),                # no AMX: nothing to suggest
    (".venv-llamacpp-avx2", ["avx2", "avx512f", "amx_int8"], False),  # the AVX2 build has no AMX kernels
])
def test_a_llamacpp_worker_killed_by_a_signal_names_the_build_without_amx_only_where_it_applies(
        tmp_path, monkeypatch, venv, flags, hint):
    monkeypatch.setattr(run.harness, "machine_info", lambda: {"cpu_flags": flags})
    with (tmp_path / "log.txt").open("w") as log, pytest.raises(SystemExit) as exc:
        run.Worker("llamacpp", [_python_in(tmp_path / venv), "-c", SEGFAULT], log)
    message = str(exc.value)
    assert message.startswith("error: worker llamacpp exited (status -11)") and message.endswith("see log.txt")
    assert ("LLAMACPP_ISA=native-no-amx bash bench/peers/llamacpp_setup.sh" in message) is hint


@pytest.mark.parametrize("system_info, hint", [("AVX512 = 1 | AMX_INT8 = 1 |", True), ("AVX512 = 1 |", False)])
def test_a_llamacpp_worker_that_dies_after_it_started_is_judged_by_its_own_kernels(tmp_path, monkeypatch,
                                                                                  system_info, hint):
    """Once the worker has reported llama.cpp's system info, that decides: a build without AMX kernels
    that crashes gets no AMX hint, even on a CPU with AMX."""
    monkeypatch.setattr(run.harness, "machine_info", lambda: {"cpu_flags": ["avx2", "avx512f", "amx_int8"]})
    hello = json.dumps({"ready": True, "info": {"system_info": system_info}})
    code = f"import sys; print({hello!r}, flush=True); sys.stdin.readline(); {SEGFAULT}"
    with (tmp_path / "log.txt").open("w") as log:
        worker = run.Worker("llamacpp", [_python_in(tmp_path / ".venv-llamacpp"), "-c", code], log)
        with pytest.raises(SystemExit) as exc:
            worker.request({"prompt": "x"})
    message = str(exc.value)
    assert message.startswith("error: worker llamacpp exited (status -11)")
    assert ("LLAMACPP_ISA=native-no-amx" in message) is hint


CPUID_BITS = r"""
#include <cpuid.h>
#include <stdio.h>
int main(void) {
    unsigned a, b, c, d, a1, b1, c1, d1;
    __cpuid_count(7, 0, a, b, c, d);
    __cpuid_count(7, 1, a1, b1, c1, d1);
    printf("%u %u %u\n", (b >> 5) & 1, (b >> 16) & 1, (a1 >> 4) & 1);   /* AVX2, AVX512F, AVX-VNNI */
    return 0;
}
"""


def _cpu_can_hide_avx512_and_has_avx_vnni() -> bool:
    import shutil
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    flags = next((ln.split(":", 1)[1].split() for ln in text.splitlines() if ln.startswith("flags")), [])
    return {"cpuid_fault", "avx512f", "avx_vnni"} <= set(flags) and shutil.which("gcc") is not None


@pytest.mark.skipif(not _cpu_can_hide_avx512_and_has_avx_vnni(),
                    reason="needs a CPU with AVX-512 and AVX-VNNI that can make CPUID fault, and gcc")
@pytest.mark.parametrize("keep, expected", [(False, "1 0 0"), (True, "1 0 1")])
def test_the_cpu_mask_hides_avx512_and_leaves_avx_vnni_only_when_asked(tmp_path, keep, expected):
    """bench/cpu_mask.py: what a program's own CPUID instruction answers under the mask: AVX2 stays,
    AVX-512 goes, and AVX-VNNI (Intel's client cores since Alder Lake) stays only with keep_avx_vnni."""
    import subprocess

    import cpu_mask

    (tmp_path / "bits.c").write_text(CPUID_BITS)
    subprocess.run(["gcc", "-O1", "-o", str(tmp_path / "bits"), str(tmp_path / "bits.c")], check=True)
    unmasked = subprocess.run([str(tmp_path / "bits")], capture_output=True, text=True, check=True).stdout.split()
    assert unmasked == ["1", "1", "1"]
    masked = subprocess.run([str(tmp_path / "bits")], env=cpu_mask.environment(keep_avx_vnni=keep),
                            capture_output=True, text=True, check=True).stdout.strip()
    assert masked == expected
