"""Run benchmarks as if this CPU had AVX2 and no AVX-512 (bench/cpu_features/hide_avx512.c).

ONNX Runtime, NumPy and the other libraries choose their kernels from what the CPUID instruction
reports when they start. hide_avx512.so, preloaded, answers CPUID with the AVX-512, VNNI and BF16
bits cleared, so on an AVX-512 machine they run the kernels an AVX2-only CPU (AMD Zen 3, Intel
before Ice Lake) would run. The cores, caches and memory stay this machine's: a figure measured so
is "AVX2 kernels on <this CPU>", not a Zen 3 figure. llama.cpp picks its kernels when it is
compiled: its AVX2-only peer is a separate build (LLAMACPP_ISA=avx2 bench/peers/llamacpp_setup.sh).
With --keep-avx-vnni (SPECTR_KEEP_AVX_VNNI=1 in the environment) AVX-VNNI stays visible: the kernels
of Intel's client cores since Alder Lake, which have AVX2 and AVX-VNNI and no AVX-512 (llama.cpp's peer:
LLAMACPP_ISA=avx2-vnni).

    .venv/bin/python bench/cpu_mask.py --check                       # builds the library, shows what NumPy sees
    .venv/bin/python bench/cpu_mask.py -- .venv/bin/python bench/int4_levers.py ...   # any command
    .venv/bin/python bench/cpu_mask.py --keep-avx-vnni -- ...        # AVX2 and AVX-VNNI
    .venv/bin/python bench/run.py --suite int4-peers --hide-avx512   # every worker of a run

Needs gcc and a CPU and kernel that can make CPUID fault (the "cpuid_fault" flag in /proc/cpuinfo);
without them the library refuses to start the program rather than hide nothing.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parent
SOURCE = BENCH / "cpu_features" / "hide_avx512.c"
LIBRARY = BENCH / ".build" / "hide_avx512.so"
KEEP_AVX_VNNI = "SPECTR_KEEP_AVX_VNNI"


def hidden(keep_avx_vnni: bool = False) -> str:
    """What the mask hides, in words."""
    return (f"AVX-512 (F, DQ, CD, BW, VL, IFMA, VBMI, VBMI2, VNNI, BF16, FP16, BITALG, VPOPCNTDQ), "
            f"{'' if keep_avx_vnni else 'AVX-VNNI, '}AMX")


def running_masked() -> str | None:
    """What the mask hides from this process, in words, or None when it runs unmasked."""
    if LIBRARY.name not in os.environ.get("LD_PRELOAD", ""):
        return None
    return hidden(os.environ.get(KEEP_AVX_VNNI) == "1")


def library() -> Path:
    """The preload library, compiled when missing or older than its source."""
    if not Path("/proc/cpuinfo").is_file() or "cpuid_fault" not in Path("/proc/cpuinfo").read_text():
        raise SystemExit("error: this CPU or kernel cannot make CPUID fault (no cpuid_fault flag in /proc/cpuinfo); "
                         "AVX-512 cannot be hidden here: measure on an AVX2-only machine instead")
    if not LIBRARY.exists() or LIBRARY.stat().st_mtime < SOURCE.stat().st_mtime:
        LIBRARY.parent.mkdir(parents=True, exist_ok=True)
        tmp = LIBRARY.with_name(LIBRARY.name + f".{os.getpid()}")
        try:
            subprocess.run(["gcc", "-O2", "-shared", "-fPIC", "-o", str(tmp), str(SOURCE)], check=True)
        except (OSError, subprocess.CalledProcessError) as err:
            raise SystemExit(f"error: cannot compile {SOURCE} ({err}); install gcc") from None
        os.replace(tmp, LIBRARY)
    return LIBRARY


def environment(base: dict | None = None, keep_avx_vnni: bool = False) -> dict:
    """An environment whose processes run with AVX-512 hidden (preloaded before anything else)."""
    env = dict(os.environ if base is None else base)
    env["LD_PRELOAD"] = " ".join([str(library())] + env.get("LD_PRELOAD", "").split())
    env[KEEP_AVX_VNNI] = "1" if keep_avx_vnni else "0"
    return env


def command(cmd: list[str], keep_avx_vnni: bool = False) -> list[str]:
    """cmd run with AVX-512 hidden (through env(1): for a subprocess started with its own command line)."""
    return ["env", f"LD_PRELOAD={library()}", f"{KEEP_AVX_VNNI}={int(keep_avx_vnni)}"] + cmd


def seen_by_numpy(env: dict | None = None) -> dict[str, bool]:
    """What NumPy's dispatcher finds in a child process with env: a check that the mask took."""
    code = ("import json; from numpy._core._multiarray_umath import __cpu_features__ as f; "
            "print(json.dumps({k: bool(f.get(k)) for k in ('AVX2', 'FMA3', 'AVX512F', 'AVX512_SKX', 'AVX512VNNI', "
            "'AVX512BF16')}))")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    import json
    return json.loads(out.stdout)


def check(keep_avx_vnni: bool = False) -> dict[str, bool]:
    """seen_by_numpy under the mask; SystemExit unless AVX2 is there and AVX-512 is not."""
    seen = seen_by_numpy(environment(keep_avx_vnni=keep_avx_vnni))
    if not seen["AVX2"] or seen["AVX512F"] or seen["AVX512VNNI"]:
        raise SystemExit(f"error: the CPU mask did not take (NumPy sees {seen})")
    return seen


def main(argv=None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    keep = argv[:1] == ["--keep-avx-vnni"]
    argv = argv[keep:]
    if argv[:1] == ["--check"]:
        print(f"{library()}\nwithout the mask NumPy sees {seen_by_numpy()}\nwith it {check(keep)}")
        return
    if argv[:1] == ["--"]:
        argv = argv[1:]
    if not argv:
        raise SystemExit(__doc__)
    check(keep)
    os.execvpe(argv[0], argv, environment(keep_avx_vnni=keep))


if __name__ == "__main__":
    main()
