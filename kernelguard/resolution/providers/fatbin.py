"""Which GPU code a CUDA extension (.so) carries -- SASS and PTX targets read from the file, no GPU needed.

Whether that code serves a given GPU is decided by :mod:`kernelguard.resolution.capability` (:meth:`CudaTargets.runs_on`).

Docker builds have no GPU, so we cannot ask the driver whether ``causal_conv1d_cuda*.so`` loads on the target
card. Instead we read the fat binaries that nvcc embeds in the ELF file:

* ``.nv_fatbin`` holds the fatbins of a linked .so/executable, ``__nv_relfatbin`` those of relocatable objects.
  When neither exists we follow the data pointers of the ``__fatBinC_Wrapper_t`` records in
  ``.nvFatBinSegment``, which the CUDA runtime itself uses to find the fatbins.
* A section holds one or more fatbin containers back to back. Container header (16 bytes, little-endian)::

      u32 magic 0xBA55ED50 | u16 version | u16 header_size | u64 fat_size (bytes of entries after the header)

* Each entry starts with a header of ``entry_header_size`` bytes (64 on sm < 100; 80-128 on newer toolchains,
  which append the object name and extra fields), followed by ``payload_size`` bytes of payload::

      0x00 u16 kind (1 = PTX, 2 = ELF cubin, 8 = LTO IR) | 0x02 u16 version 0x0101
      0x04 u32 entry_header_size                         | 0x08 u64 payload_size
      0x10 u64 compressed size / misc                    | 0x18 u32 code version (minor, major)
      0x1c u32 arch (SM number: 80, 90, 100, 120 ...)    | 0x20 u32 name offset | 0x24 u32 name length
      0x28 u64 flags                                     | ...

  Flags seen: 0x1 64-bit, 0x10 Linux host, 0x8000 (0x1000/0x2000 on older toolchains) compressed payload,
  0x100000 arch-specific target (``sm_90a``), 0x200000 family-specific target (``sm_100f``). Everything we
  need is in the entry header, so compressed payloads never have to be decompressed.

The layout follows n-eiling/cuda-fatbin-decompression (fatbin-decompress.h) and GrigoryEvko/nvopen-tools
(fatbin/FORMAT_SPECIFICATION.md), and was checked against nvcc 13.0 output (plain, ``-Xfatbin -compress-all``,
sm_90a, sm_100a, sm_100f, sm_120) and the causal-conv1d 1.7.0 wheel.
"""

from __future__ import annotations

import os
import re
import shutil
import struct
import subprocess
from dataclasses import dataclass
from typing import BinaryIO

from ..capability import PTX, SASS, CodeTarget, ComputeCapability, code_runs_on

__all__ = ["CudaTargets", "read_cuda_targets"]

FATBIN_MAGIC = 0xBA55ED50
FATBIN_WRAPPER_MAGIC = 0x466243B1  # __fatBinC_Wrapper_t.magic in .nvFatBinSegment

ENTRY_KIND_PTX = 1
ENTRY_KIND_CUBIN = 2

FLAG_ARCH_SPECIFIC = 0x100000  # sm_90a / compute_90a
FLAG_FAMILY_SPECIFIC = 0x200000  # sm_100f / compute_100f

FATBIN_SECTIONS = (".nv_fatbin", "__nv_relfatbin")
WRAPPER_SECTION = ".nvFatBinSegment"

_CONTAINER_HEADER = struct.Struct("<IHHQ")  # magic, version, header_size, fat_size
_ENTRY_PREFIX = struct.Struct("<HHIQ")  # kind, version, entry_header_size, payload_size
_ENTRY_ARCH_OFFSET = 0x1C
_ENTRY_FLAGS_OFFSET = 0x28
_ENTRY_MIN_HEADER = 0x30  # must reach past the flags field
_WRAPPER = struct.Struct("<IIQQ")  # magic, version, data pointer, filename_or_fatbins

_ELF64_HEADER = struct.Struct("<16sHHIQQQIHHHHHH")
_ELF64_SECTION = struct.Struct("<IIQQQQIIQQ")
_SHT_NOBITS = 8
_SHN_XINDEX = 0xFFFF

_SCAN_CHUNK = 1 << 20  # bytes read at a time while looking for the next container magic
_CUOBJDUMP_TIMEOUT_S = 120


@dataclass(frozen=True, slots=True)
class CudaTargets:
    """GPU code found in one file. ``error`` is set (and the sets may be partial) when it could not be read."""

    path: str
    sass: frozenset[str]  # machine code, e.g. {"sm_80", "sm_90", "sm_90a"}
    ptx: frozenset[str]  # virtual ISA the driver can JIT-compile, e.g. {"compute_90"}
    method: str  # "elf-fatbin" or "cuobjdump"
    error: str | None = None

    def runs_on(self, arch: ComputeCapability | str) -> tuple[bool, str]:
        """(ok, sentence) for a GPU of compute capability ``arch`` ("9.0", "8.6", "9.0a": the 'a'/'f' of a
        build target is ignored, the GPU itself is just 9.0). Raises ConfigError for a non-capability."""
        device = ComputeCapability.parse(arch, source="arch").base
        if self.error is not None:
            return False, f"cannot tell whether {self.path} runs on {device} GPUs: {self.error}"
        return code_runs_on(self.sass, self.ptx, device)


class _Unreadable(Exception):
    """A malformed or unsupported file; turned into ``CudaTargets.error``, never escapes this module."""


@dataclass(frozen=True, slots=True)
class _Section:
    name: str
    kind: int
    address: int
    offset: int
    size: int


# --------------------------------------------------------------------------------------------- reading


def read_cuda_targets(path: str | os.PathLike[str], *, use_cuobjdump: bool = True) -> CudaTargets:
    """Lists the SASS and PTX targets embedded in ``path``; never raises for unreadable or non-CUDA files."""
    path_text = os.fspath(path)
    if use_cuobjdump and shutil.which("cuobjdump"):
        from_tool = _read_with_cuobjdump(path_text)
        if from_tool is not None:
            return from_tool
    # cuobjdump missing, failed or listed nothing: our own parser also explains *why* there is no code.
    return _read_with_elf_parser(path_text)


def _read_with_elf_parser(path: str) -> CudaTargets:
    sass: set[str] = set()
    ptx: set[str] = set()
    try:
        with open(path, "rb") as file:
            file_size = os.fstat(file.fileno()).st_size
            sections = _read_section_table(file, file_size)
            _collect_fatbin_targets(file, file_size, sections, sass, ptx)
    except (OSError, _Unreadable) as exc:
        return _targets(path, sass, ptx, "elf-fatbin", _describe(exc))
    if not sass and not ptx:
        return _targets(
            path, sass, ptx, "elf-fatbin", "fatbin holds no SASS or PTX (only LTO IR or unknown kinds)"
        )
    return _targets(path, sass, ptx, "elf-fatbin", None)


def _targets(path: str, sass: set[str], ptx: set[str], method: str, error: str | None) -> CudaTargets:
    return CudaTargets(path=path, sass=frozenset(sass), ptx=frozenset(ptx), method=method, error=error)


def _describe(exc: OSError | _Unreadable) -> str:
    if isinstance(exc, OSError):
        return f"cannot read file: {exc.strerror or exc}"
    return str(exc)


def _read_exactly(file: BinaryIO, offset: int, size: int, file_size: int, what: str) -> bytes:
    if offset < 0 or offset + size > file_size:
        raise _Unreadable(f"truncated file: {what} at offset {offset} runs past the end ({file_size} bytes)")
    file.seek(offset)
    data = file.read(size)
    if len(data) != size:
        raise _Unreadable(f"truncated file: short read of {what} at offset {offset}")
    return data


# ------------------------------------------------------------------------------------------------- ELF


def _read_section_table(file: BinaryIO, file_size: int) -> list[_Section]:
    table_offset, entry_size, count, names_index = _section_table_location(file, file_size)
    # One read for the whole table: a .so has tens of sections, but large ones can have thousands.
    table = _read_exactly(file, table_offset, count * entry_size, file_size, "section header table")
    raw = [_ELF64_SECTION.unpack_from(table, index * entry_size) for index in range(count)]
    if names_index >= count:
        raise _Unreadable(f"malformed ELF: section name table index {names_index} >= {count}")
    names_offset, names_size = raw[names_index][4], raw[names_index][5]
    names = _read_exactly(file, names_offset, names_size, file_size, "section name table")
    return [
        _Section(name=_c_string(names, name), kind=kind, address=address, offset=offset, size=size)
        for name, kind, _, address, offset, size, *_ in raw
    ]


def _section_table_location(file: BinaryIO, file_size: int) -> tuple[int, int, int, int]:
    """(offset, entry size, entry count, index of the section-name table) from the ELF header."""
    header = _read_elf_header_bytes(file, file_size)
    *_, table_offset, _, _, _, _, entry_size, count, names_index = _ELF64_HEADER.unpack(header)
    if table_offset == 0:
        raise _Unreadable("ELF file has no section headers (fully stripped), cannot locate .nv_fatbin")
    if entry_size < _ELF64_SECTION.size:
        raise _Unreadable(f"malformed ELF: section header size {entry_size}")
    if count == 0 or names_index == _SHN_XINDEX:
        # More than 0xff00 sections: the real count / name-table index live in section header 0.
        first_bytes = _read_exactly(file, table_offset, _ELF64_SECTION.size, file_size, "section header 0")
        first = _ELF64_SECTION.unpack(first_bytes)
        count = count or first[5]
        names_index = first[6] if names_index == _SHN_XINDEX else names_index
    return table_offset, entry_size, count, names_index


def _read_elf_header_bytes(file: BinaryIO, file_size: int) -> bytes:
    ident = file.read(16)
    if not ident.startswith(b"\x7fELF"):
        raise _Unreadable("not an ELF file")
    if len(ident) < 16:
        raise _Unreadable(f"truncated file: ELF header cut off after {len(ident)} bytes")
    if ident[4] != 2 or ident[5] != 1:
        # Every CUDA host platform (x86_64, aarch64, ppc64le) uses 64-bit little-endian ELF.
        raise _Unreadable("unsupported ELF: only 64-bit little-endian files carry CUDA fatbins")
    return _read_exactly(file, 0, _ELF64_HEADER.size, file_size, "ELF header")


def _c_string(table: bytes, offset: int) -> str:
    end = table.find(b"\0", offset)
    return table[offset : end if end >= 0 else len(table)].decode("latin-1")


# ---------------------------------------------------------------------------------------------- fatbin


def _collect_fatbin_targets(
    file: BinaryIO, file_size: int, sections: list[_Section], sass: set[str], ptx: set[str]
) -> None:
    fatbin_sections = [s for s in sections if s.name in FATBIN_SECTIONS and s.kind != _SHT_NOBITS]
    for section in fatbin_sections:
        _check_inside_file(section, file_size)
        found = _walk_containers(file, section.offset, section.offset + section.size, sass, ptx)
        if not found:
            raise _Unreadable(f"no fatbin container (magic 0x{FATBIN_MAGIC:08X}) in {section.name}")
    if fatbin_sections:
        return
    wrapper_section = next((s for s in sections if s.name == WRAPPER_SECTION), None)
    if wrapper_section is None or not _follow_wrappers(file, file_size, sections, wrapper_section, sass, ptx):
        raise _Unreadable("no embedded CUDA code")


def _check_inside_file(section: _Section, file_size: int) -> None:
    if section.offset + section.size > file_size:
        raise _Unreadable(
            f"truncated file: section {section.name} ends at {section.offset + section.size}, "
            f"file has {file_size} bytes"
        )


def _walk_containers(file: BinaryIO, start: int, end: int, sass: set[str], ptx: set[str]) -> int:
    """Reads every container in [start, end); returns how many were found. Only headers are read."""
    containers = 0
    position = _find_magic(file, start, end)
    while position is not None:
        position = _read_container(file, position, end, sass, ptx)
        containers += 1
        position = _find_magic(file, position, end)
    return containers


def _find_magic(file: BinaryIO, start: int, end: int) -> int | None:
    """Start of the next container at or after ``start``. We only ever scan the gap between containers
    (zero padding, or nothing), never payload bytes, so a magic-looking value cannot be hit by accident."""
    magic = struct.pack("<I", FATBIN_MAGIC)
    position = start
    while position + _CONTAINER_HEADER.size <= end:
        file.seek(position)
        chunk = file.read(min(_SCAN_CHUNK, end - position))
        hit = chunk.find(magic)
        if hit >= 0:
            return position + hit if position + hit + _CONTAINER_HEADER.size <= end else None
        if len(chunk) < _CONTAINER_HEADER.size:
            return None
        # Overlap chunks by a few bytes so a magic split across two reads is still seen.
        position += len(chunk) - (len(magic) - 1)
    return None


def _read_container(file: BinaryIO, start: int, end: int, sass: set[str], ptx: set[str]) -> int:
    """Records the targets of the container at ``start``; returns the offset just past it."""
    _, _, header_size, fat_size = _CONTAINER_HEADER.unpack(_read_at(file, start, _CONTAINER_HEADER.size))
    entries_end: int = start + header_size + fat_size
    if header_size < _CONTAINER_HEADER.size:
        raise _Unreadable(f"malformed fatbin: container at offset {start} has header size {header_size}")
    if entries_end > end:
        raise _Unreadable(
            f"truncated fatbin: container at offset {start} needs {header_size + fat_size} bytes, "
            f"only {end - start} left in the section"
        )
    entry = start + header_size
    while entry < entries_end:
        entry = _read_entry(file, entry, entries_end, sass, ptx)
    return entries_end


def _read_entry(file: BinaryIO, start: int, container_end: int, sass: set[str], ptx: set[str]) -> int:
    """Records one entry's target; returns the offset of the next entry."""
    if start + _ENTRY_MIN_HEADER > container_end:
        raise _Unreadable(f"truncated fatbin: entry header at offset {start} runs past its container")
    header = _read_at(file, start, _ENTRY_MIN_HEADER)
    kind, _, header_size, payload_size = _ENTRY_PREFIX.unpack_from(header)
    if header_size < _ENTRY_MIN_HEADER or start + header_size + payload_size > container_end:
        raise _Unreadable(f"truncated fatbin: entry at offset {start} runs past its container")
    (arch_number,) = struct.unpack_from("<I", header, _ENTRY_ARCH_OFFSET)
    (flags,) = struct.unpack_from("<Q", header, _ENTRY_FLAGS_OFFSET)
    capability = ComputeCapability(arch_number // 10, arch_number % 10, _arch_suffix(flags))
    if kind == ENTRY_KIND_CUBIN:
        sass.add(CodeTarget(capability, SASS).name)
    elif kind == ENTRY_KIND_PTX:
        ptx.add(CodeTarget(capability, PTX).name)
    # Other kinds (LTO IR for -dlto, ...) cannot be loaded by the runtime as they are, so they do not count.
    next_entry: int = start + header_size + payload_size
    return next_entry


def _read_at(file: BinaryIO, offset: int, size: int) -> bytes:
    file.seek(offset)
    data = file.read(size)
    if len(data) != size:
        raise _Unreadable(f"truncated file: fatbin data at offset {offset} cut off")
    return data


def _arch_suffix(flags: int) -> str:
    if flags & FLAG_ARCH_SPECIFIC:
        return "a"
    if flags & FLAG_FAMILY_SPECIFIC:
        return "f"
    return ""


def _follow_wrappers(
    file: BinaryIO,
    file_size: int,
    sections: list[_Section],
    wrapper_section: _Section,
    sass: set[str],
    ptx: set[str],
) -> int:
    """Fallback for fatbins stored outside .nv_fatbin: parse the containers each wrapper points at."""
    _check_inside_file(wrapper_section, file_size)
    raw = _read_exactly(file, wrapper_section.offset, wrapper_section.size, file_size, WRAPPER_SECTION)
    records = (_WRAPPER.unpack_from(raw, at) for at in range(0, len(raw) - _WRAPPER.size + 1, 8))
    pointers = {data_pointer for magic, _, data_pointer, _ in records if magic == FATBIN_WRAPPER_MAGIC}
    followed = 0
    for address in sorted(pointers):
        holder = _section_holding(sections, address)
        if holder is None:
            continue  # pointer left for a relocation to fill in (relocatable object): nothing to follow
        _check_inside_file(holder, file_size)
        container_start = holder.offset + (address - holder.address)
        if _find_magic(file, container_start, container_start + _CONTAINER_HEADER.size) == container_start:
            _read_container(file, container_start, holder.offset + holder.size, sass, ptx)
            followed += 1
    return followed


def _section_holding(sections: list[_Section], address: int) -> _Section | None:
    for section in sections:
        loaded = section.kind != _SHT_NOBITS and section.address != 0
        if loaded and section.address <= address < section.address + section.size:
            return section
    return None


# ------------------------------------------------------------------------------------------- cuobjdump

_CUOBJDUMP_LINE = re.compile(r"^\s*(ELF|PTX) file\s+\d+:\s*.*?\.((?:sm|compute)_\w+)\.(?:cubin|ptx)\s*$")


def _read_with_cuobjdump(path: str) -> CudaTargets | None:
    """Targets as cuobjdump lists them, or None when it fails or lists nothing (the ELF parser then decides)."""
    try:
        completed = subprocess.run(
            ["cuobjdump", "--list-elf", "--list-ptx", path],
            capture_output=True,
            text=True,
            timeout=_CUOBJDUMP_TIMEOUT_S,
            check=False,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    if completed.returncode != 0:
        return None
    sass, ptx = _parse_cuobjdump_listing(completed.stdout)
    if not sass and not ptx:
        return None
    return _targets(path, sass, ptx, "cuobjdump", None)


def _parse_cuobjdump_listing(listing: str) -> tuple[set[str], set[str]]:
    """Parses lines like ``ELF file    1: ext.1.sm_90a.cubin`` / ``PTX file    1: ext.1.sm_90.ptx``."""
    sass: set[str] = set()
    ptx: set[str] = set()
    for line in listing.splitlines():
        match = _CUOBJDUMP_LINE.match(line)
        if match is None:
            continue
        kind, file_target = match.groups()
        code = CodeTarget.parse(file_target)
        if code is None:
            continue
        # cuobjdump names PTX files after the sm number too; the PTX itself targets compute_<same>.
        (sass if kind == "ELF" else ptx).add(CodeTarget(code.capability, SASS if kind == "ELF" else PTX).name)
    return sass, ptx
