"""kernelguard.resolution.providers.fatbin (+ capability rules): reading GPU targets out of CUDA extensions without a GPU.

CI has no nvcc, so most tests build synthetic ELF files holding hand-made fatbin containers (layout documented in
the module). One test compiles a real extension when nvcc is on PATH; one reads the causal-conv1d wheel from the
git-ignored .whl/ folder when it is present.
"""

from __future__ import annotations

import os
import shutil
import stat
import struct
import subprocess
import zipfile
from pathlib import Path

import pytest

from kernelguard.errors import ConfigError
from kernelguard.resolution.providers.fatbin import CudaTargets, read_cuda_targets

FATBIN_MAGIC = 0xBA55ED50
WRAPPER_MAGIC = 0x466243B1
KIND_PTX, KIND_CUBIN, KIND_LTO_IR = 1, 2, 8
FLAGS_64BIT_LINUX = 0x11
FLAG_COMPRESSED = 0x8000
FLAG_ARCH_SPECIFIC = 0x100000
FLAG_FAMILY_SPECIFIC = 0x200000
ELF_HEADER_SIZE = 64
ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"


# ------------------------------------------------------------------------------------------ fixture builders


def fatbin_entry(kind: int, arch: int, *, flags: int = FLAGS_64BIT_LINUX, header_size: int = 64) -> bytes:
    """One entry as nvcc writes it: header (arch at 0x1c, flags at 0x28), then payload padded to 8 bytes."""
    compressed = bool(flags & FLAG_COMPRESSED)
    payload = (ZSTD_MAGIC if compressed else b"\x7fELF" if kind == KIND_CUBIN else b".ver") + bytes(20)
    header = struct.pack("<HHIQQHHIIIQ", kind, 0x0101, header_size, len(payload), 0, 8, 1, arch, 0, 0, flags)
    return header.ljust(header_size, b"\0") + payload


def fatbin_container(*entries: bytes) -> bytes:
    body = b"".join(entries)
    return struct.pack("<IHHQ", FATBIN_MAGIC, 1, 16, len(body)) + body


def sm(arch: int, flags: int = FLAGS_64BIT_LINUX, header_size: int = 64) -> bytes:
    return fatbin_entry(KIND_CUBIN, arch, flags=flags, header_size=header_size)


def ptx(arch: int, flags: int = FLAGS_64BIT_LINUX, header_size: int = 64) -> bytes:
    return fatbin_entry(KIND_PTX, arch, flags=flags, header_size=header_size)


def elf64(sections: list[tuple[str, bytes]]) -> bytes:
    """Minimal ELF64 little-endian shared object: sections laid out from offset 64, each address == offset,
    so the first section lives at address 64 (used by the .nvFatBinSegment test)."""
    names = b"\0" + b"".join(name.encode() + b"\0" for name, _ in sections) + b".shstrtab\0"
    body = bytearray()
    headers = [bytes(64)]  # section 0 is always the null section
    name_offset = 1
    for name, data in [*sections, (".shstrtab", names)]:
        while (ELF_HEADER_SIZE + len(body)) % 8:
            body.append(0)
        offset = ELF_HEADER_SIZE + len(body)
        headers.append(struct.pack("<IIQQQQIIQQ", name_offset, 1, 2, offset, offset, len(data), 0, 0, 8, 0))
        name_offset += len(name) + 1
        body += data
    while len(body) % 8:
        body.append(0)
    table_offset = ELF_HEADER_SIZE + len(body)
    ident = b"\x7fELF" + bytes([2, 1, 1]) + bytes(9)  # 64-bit, little-endian, version 1
    header = struct.pack(
        "<16sHHIQQQIHHHHHH",
        ident,
        3,  # e_type: shared object
        62,  # e_machine: x86-64
        1,  # e_version
        0,  # e_entry
        0,  # e_phoff: no program headers, the reader never needs them
        table_offset,  # e_shoff
        0,  # e_flags
        ELF_HEADER_SIZE,  # e_ehsize
        0,  # e_phentsize
        0,  # e_phnum
        64,  # e_shentsize
        len(headers),  # e_shnum
        len(headers) - 1,  # e_shstrndx: .shstrtab is the last section
    )
    return header + bytes(body) + b"".join(headers)


def so_with_fatbin(tmp_path: Path, *containers: bytes, section: str = ".nv_fatbin") -> Path:
    path = tmp_path / "ext.so"
    path.write_bytes(elf64([(".text", b"\xc3" * 16), (section, b"".join(containers))]))
    return path


def read(path: Path) -> CudaTargets:
    return read_cuda_targets(path, use_cuobjdump=False)


# --------------------------------------------------------------------------------------------- reading


def test_sm80_sm86_only_rejects_9_0_with_exact_sentence(tmp_path: Path) -> None:
    targets = read(so_with_fatbin(tmp_path, fatbin_container(sm(80), sm(86))))
    assert targets == CudaTargets(
        path=str(tmp_path / "ext.so"),
        sass=frozenset({"sm_80", "sm_86"}),
        ptx=frozenset(),
        method="elf-fatbin",
    )
    assert targets.runs_on("9.0") == (
        False,
        "built for sm_80, sm_86 (SASS) and no PTX; needs sm_90 SASS or PTX <= compute_90",
    )
    assert targets.runs_on("8.6") == (
        True,
        "built for sm_80, sm_86 (SASS) and no PTX; sm_86 SASS runs on 8.6 GPUs",
    )
    assert targets.runs_on("8.9") == (
        True,
        "built for sm_80, sm_86 (SASS) and no PTX; sm_86 SASS runs on 8.9 GPUs",
    )


def test_sm86_does_not_run_on_lower_minor(tmp_path: Path) -> None:
    targets = read(so_with_fatbin(tmp_path, fatbin_container(sm(86))))
    assert targets.runs_on("8.0") == (
        False,
        "built for sm_86 (SASS) and no PTX; needs sm_80 SASS or PTX <= compute_80",
    )
    assert targets.runs_on("8.7") == (
        True,
        "built for sm_86 (SASS) and no PTX; sm_86 SASS runs on 8.7 GPUs",
    )


def test_sm90_runs_on_9_0_not_on_10_0(tmp_path: Path) -> None:
    targets = read(so_with_fatbin(tmp_path, fatbin_container(sm(90))))
    assert (targets.sass, targets.ptx, targets.error) == (frozenset({"sm_90"}), frozenset(), None)
    assert targets.runs_on("9.0") == (
        True,
        "built for sm_90 (SASS) and no PTX; sm_90 SASS runs on 9.0 GPUs",
    )
    assert targets.runs_on("10.0") == (
        False,
        "built for sm_90 (SASS) and no PTX; needs sm_100 SASS or PTX <= compute_100",
    )


def test_ptx_only_is_jit_compiled_on_newer_arch(tmp_path: Path) -> None:
    targets = read(so_with_fatbin(tmp_path, fatbin_container(ptx(80))))
    assert (targets.sass, targets.ptx) == (frozenset(), frozenset({"compute_80"}))
    assert targets.runs_on("9.0") == (True, "only PTX compute_80, JIT-compiled at first load on 9.0 GPUs")
    assert targets.runs_on("7.5") == (
        False,
        "built for no SASS and PTX compute_80; needs sm_70..sm_75 SASS or PTX <= compute_75",
    )


def test_ptx_fallback_next_to_sass_names_the_jit(tmp_path: Path) -> None:
    targets = read(so_with_fatbin(tmp_path, fatbin_container(sm(80), sm(90), ptx(90))))
    assert targets.runs_on("12.0") == (
        True,
        (
            "built for sm_80, sm_90 (SASS) and PTX compute_90; no SASS runs on 12.0 GPUs, "
            "so PTX compute_90 is JIT-compiled at first load"
        ),
    )
    assert targets.runs_on("9.0") == (
        True,
        "built for sm_80, sm_90 (SASS) and PTX compute_90; sm_90 SASS runs on 9.0 GPUs",
    )


def test_arch_specific_sm90a_runs_only_on_exactly_9_0(tmp_path: Path) -> None:
    targets = read(so_with_fatbin(tmp_path, fatbin_container(sm(90, FLAGS_64BIT_LINUX | FLAG_ARCH_SPECIFIC))))
    assert targets.sass == frozenset({"sm_90a"})
    assert targets.runs_on("9.0") == (
        True,
        "built for sm_90a (SASS) and no PTX; sm_90a SASS runs on 9.0 GPUs",
    )
    assert targets.runs_on("9.0a") == targets.runs_on("9.0")
    assert targets.runs_on("10.0") == (
        False,
        "built for sm_90a (SASS) and no PTX; needs sm_100 SASS or PTX <= compute_100",
    )


def test_arch_specific_ptx_is_not_forward_compatible(tmp_path: Path) -> None:
    targets = read(
        so_with_fatbin(tmp_path, fatbin_container(ptx(90, FLAGS_64BIT_LINUX | FLAG_ARCH_SPECIFIC)))
    )
    assert targets.ptx == frozenset({"compute_90a"})
    assert targets.runs_on("9.0") == (True, "only PTX compute_90a, JIT-compiled at first load on 9.0 GPUs")
    assert targets.runs_on("10.0")[0] is False


def test_family_specific_sm100f_runs_within_the_family(tmp_path: Path) -> None:
    # nvcc >= 12.9 writes a 112-byte entry header for sm_100+ cubins.
    entry = sm(100, FLAGS_64BIT_LINUX | FLAG_FAMILY_SPECIFIC, header_size=112)
    targets = read(so_with_fatbin(tmp_path, fatbin_container(entry)))
    assert targets.sass == frozenset({"sm_100f"})
    assert targets.runs_on("10.3") == (
        True,
        "built for sm_100f (SASS) and no PTX; sm_100f SASS runs on 10.3 GPUs",
    )
    assert targets.runs_on("12.0")[0] is False


def test_walks_all_containers_with_padding_compression_and_long_headers(tmp_path: Path) -> None:
    compressed = FLAGS_64BIT_LINUX | FLAG_COMPRESSED
    first = fatbin_container(sm(75, compressed), sm(80, compressed))
    second = fatbin_container(sm(120, header_size=112), ptx(120, compressed, header_size=80))
    third = fatbin_container(sm(89, compressed, header_size=120))
    path = so_with_fatbin(tmp_path, first, bytes(16), second, third, bytes(8))  # zero padding between some
    targets = read(path)
    assert targets.error is None
    assert targets.sass == frozenset({"sm_75", "sm_80", "sm_89", "sm_120"})
    assert targets.ptx == frozenset({"compute_120"})


def test_relocatable_fatbin_section_is_read(tmp_path: Path) -> None:
    targets = read(so_with_fatbin(tmp_path, fatbin_container(sm(90)), section="__nv_relfatbin"))
    assert (targets.sass, targets.error) == (frozenset({"sm_90"}), None)


def test_follows_nvfatbinsegment_when_nv_fatbin_is_missing(tmp_path: Path) -> None:
    container = fatbin_container(sm(80), ptx(80))
    # The first section sits at address 64 (see elf64); the wrapper's data pointer points there.
    wrapper = struct.pack("<IIQQ", WRAPPER_MAGIC, 1, ELF_HEADER_SIZE, 0)
    path = tmp_path / "ext.so"
    path.write_bytes(elf64([(".rodata.cuda", container), (".nvFatBinSegment", wrapper)]))
    targets = read(path)
    assert (targets.sass, targets.ptx, targets.error) == (
        frozenset({"sm_80"}),
        frozenset({"compute_80"}),
        None,
    )


def test_lto_ir_only_is_reported_as_no_runnable_code(tmp_path: Path) -> None:
    targets = read(so_with_fatbin(tmp_path, fatbin_container(fatbin_entry(KIND_LTO_IR, 90))))
    assert targets.error == "fatbin holds no SASS or PTX (only LTO IR or unknown kinds)"


# ------------------------------------------------------------------------------------------ unreadable


def test_not_an_elf_sets_error_without_raising(tmp_path: Path) -> None:
    path = tmp_path / "ext.so"
    path.write_text("this is a linker script, not a library\n")
    targets = read(path)
    assert targets == CudaTargets(
        path=str(path), sass=frozenset(), ptx=frozenset(), method="elf-fatbin", error="not an ELF file"
    )
    assert targets.runs_on("9.0") == (
        False,
        f"cannot tell whether {path} runs on 9.0 GPUs: not an ELF file",
    )


def test_missing_file_sets_error(tmp_path: Path) -> None:
    targets = read(tmp_path / "absent.so")
    assert targets.error == "cannot read file: No such file or directory"


def test_elf_without_fatbin_has_no_embedded_cuda_code(tmp_path: Path) -> None:
    path = tmp_path / "plain.so"
    path.write_bytes(elf64([(".text", b"\xc3" * 16), (".data", bytes(8))]))
    targets = read(path)
    assert (targets.sass, targets.ptx, targets.error) == (frozenset(), frozenset(), "no embedded CUDA code")


def test_32_bit_elf_is_unsupported(tmp_path: Path) -> None:
    path = tmp_path / "ext32.so"
    path.write_bytes(b"\x7fELF" + bytes([1, 1, 1]) + bytes(100))
    assert read(path).error == "unsupported ELF: only 64-bit little-endian files carry CUDA fatbins"


def test_truncated_file_sets_error(tmp_path: Path) -> None:
    full = elf64([(".nv_fatbin", fatbin_container(sm(90)))])
    path = tmp_path / "cut.so"
    path.write_bytes(full[: len(full) // 2])  # the section header table at the end is lost
    error = read(path).error
    assert error is not None and error.startswith("truncated file: section header table at offset ")

    path.write_bytes(full[:10])
    assert read(path).error == "truncated file: ELF header cut off after 10 bytes"


def test_container_larger_than_its_section_is_truncated_fatbin(tmp_path: Path) -> None:
    container = fatbin_container(sm(80), sm(90))
    targets = read(so_with_fatbin(tmp_path, container[:-40]))
    assert targets.error == (
        f"truncated fatbin: container at offset 80 needs {len(container)} bytes, "
        f"only {len(container) - 40} left in the section"
    )


def test_bad_arch_string_is_a_config_error() -> None:
    targets = CudaTargets(path="x.so", sass=frozenset({"sm_90"}), ptx=frozenset(), method="elf-fatbin")
    with pytest.raises(ConfigError, match="not a compute capability"):
        targets.runs_on("hopper")
    assert targets.runs_on("sm_90")[0] is True


# ------------------------------------------------------------------------------------------- cuobjdump


def install_fake_cuobjdump(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, stdout: str, rc: int = 0) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    script = bin_dir / "cuobjdump"
    script.write_text(f"#!/bin/sh\ncat <<'EOF'\n{stdout}EOF\nexit {rc}\n")
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}")


pytestmark_posix = pytest.mark.skipif(os.name != "posix", reason="fake cuobjdump is a shell script")

LISTING = (
    "ELF file    1: causal_conv1d_cuda.1.sm_80.cubin\n"
    "ELF file    2: causal_conv1d_cuda.2.sm_90a.cubin\n"
    "PTX file    1: causal_conv1d_cuda.1.sm_90.ptx\n"
)


@pytestmark_posix
def test_cuobjdump_listing_is_used_when_available(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    install_fake_cuobjdump(tmp_path, monkeypatch, LISTING)
    path = so_with_fatbin(tmp_path, fatbin_container(sm(75)))  # differs on purpose: proves cuobjdump answered
    targets = read_cuda_targets(path)
    assert targets == CudaTargets(
        path=str(path), sass=frozenset({"sm_80", "sm_90a"}), ptx=frozenset({"compute_90"}), method="cuobjdump"
    )
    assert read_cuda_targets(path, use_cuobjdump=False).sass == frozenset({"sm_75"})


@pytestmark_posix
def test_failing_cuobjdump_falls_back_to_elf_parser(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    install_fake_cuobjdump(tmp_path, monkeypatch, "cuobjdump fatal   : Could not open input file\n", rc=1)
    path = so_with_fatbin(tmp_path, fatbin_container(sm(90)))
    targets = read_cuda_targets(path)
    assert (targets.method, targets.sass, targets.error) == ("elf-fatbin", frozenset({"sm_90"}), None)


# ------------------------------------------------------------------------------------------ real binaries

KERNEL_SOURCE = """
__global__ void add_one(float* x) { x[threadIdx.x] += 1.0f; }
extern "C" void launch(float* x) { add_one<<<1, 32>>>(x); }
"""


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not on PATH")
@pytest.mark.parametrize(
    ("gencode", "sass", "ptx_targets"),
    [
        (
            ["-gencode", "arch=compute_80,code=sm_80", "-gencode", "arch=compute_90,code=[sm_90,compute_90]"],
            {"sm_80", "sm_90"},
            {"compute_90"},
        ),
        (["-Xfatbin", "-compress-all", "-gencode", "arch=compute_90a,code=sm_90a"], {"sm_90a"}, set()),
    ],
)
def test_real_nvcc_extension(
    tmp_path: Path, gencode: list[str], sass: set[str], ptx_targets: set[str]
) -> None:
    source = tmp_path / "kernel.cu"
    source.write_text(KERNEL_SOURCE)
    library = tmp_path / "kernel.so"
    nvcc = ["nvcc", "-shared", "-Xcompiler", "-fPIC", *gencode, str(source), "-o", str(library)]
    subprocess.run(nvcc, check=True, capture_output=True, timeout=300)
    targets = read(library)
    assert (targets.sass, targets.ptx, targets.error) == (frozenset(sass), frozenset(ptx_targets), None)


CAUSAL_CONV1D_WHEELS = sorted((Path(__file__).parents[2] / ".whl").glob("causal_conv1d-*.whl"))


@pytest.mark.skipif(not CAUSAL_CONV1D_WHEELS, reason="no causal_conv1d wheel in .whl/ (git-ignored)")
def test_causal_conv1d_wheel_is_sm90(tmp_path: Path) -> None:
    with zipfile.ZipFile(CAUSAL_CONV1D_WHEELS[-1]) as wheel:
        member = next(
            name for name in wheel.namelist() if name.startswith("causal_conv1d_cuda") and ".so" in name
        )
        library = Path(wheel.extract(member, tmp_path))
    targets = read(library)
    assert (targets.sass, targets.ptx, targets.error) == (frozenset({"sm_90"}), frozenset(), None)
    assert targets.runs_on("9.0") == (
        True,
        "built for sm_90 (SASS) and no PTX; sm_90 SASS runs on 9.0 GPUs",
    )
    assert targets.runs_on("10.0")[0] is False
