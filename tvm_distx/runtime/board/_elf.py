"""Point a loaded library's imports at other functions: its GOT slots, from its ELF relocations.

A kernel library imports TVM's error reporter (``TVMFFIErrorSetRaisedFromCStrParts``),
which a board does not have; with lazy binding it is only looked up when a kernel fails,
and the process then dies of a "symbol lookup error". :func:`redirect_imports` writes the
address of a replacement into the import's slot of the global offset table, where the
dynamic linker would have written TVM's: the slot is ``load base + r_offset`` of the
relocation that names the symbol (``.rela.plt``, any architecture). Standard library only:
ELF64 little-endian files (x86-64, riscv64, aarch64), glibc's ``dlinfo`` for the load base.
"""

from __future__ import annotations

import ctypes
import mmap
import struct

__all__ = ["redirect_imports"]

_SHT_RELA, _SHT_DYNSYM = 4, 11
_PT_GNU_RELRO = 0x6474E552
_RTLD_DI_LINKMAP = 2
_PROT_READ, _PROT_WRITE = 1, 2


def _relocated_slots(path: str, names: set[str]) -> tuple[dict[str, list[int]], list[tuple]]:
    """Per symbol name, the offsets of the slots its relocations fill; and the RELRO ranges."""
    with open(path, "rb") as file:
        data = file.read()
    if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        raise OSError("not an ELF64 little-endian file")
    (phoff, shoff, _flags, _ehsize, phentsize, phnum, shentsize,
     shnum, _shstrndx) = struct.unpack_from("<QQIHHHHHH", data, 0x20)
    relro = []
    for i in range(phnum):
        kind, _flags, _offset, vaddr, _paddr, _filesz, memsz, _align = struct.unpack_from(
            "<IIQQQQQQ", data, phoff + i * phentsize)
        if kind == _PT_GNU_RELRO:
            relro.append((vaddr, vaddr + memsz))
    sections = [struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize)
                for i in range(shnum)]
    found: dict[str, list[int]] = {}
    for _name, kind, _flags, _addr, offset, size, link, _info, _align, entsize in sections:
        if kind != _SHT_RELA or sections[link][1] != _SHT_DYNSYM:
            continue
        symtab = sections[link]
        strtab = sections[symtab[6]]
        for at in range(offset, offset + size, entsize or 24):
            r_offset, r_info, _addend = struct.unpack_from("<QQq", data, at)
            symbol = r_info >> 32
            if symbol == 0:
                continue
            st_name = struct.unpack_from("<I", data, symtab[4] + symbol * (symtab[9] or 24))[0]
            start = strtab[4] + st_name
            name = data[start:data.index(b"\0", start)].decode("ascii", "replace")
            if name in names:
                found.setdefault(name, []).append(r_offset)
    return found, relro


def _load_base(handle: int) -> int:
    libc = ctypes.CDLL(None)
    try:
        dlinfo = libc.dlinfo
    except AttributeError:  # glibc before 2.34 keeps it in libdl
        dlinfo = ctypes.CDLL("libdl.so.2").dlinfo
    dlinfo.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p]
    dlinfo.restype = ctypes.c_int
    link_map = ctypes.c_void_p()
    if dlinfo(handle, _RTLD_DI_LINKMAP, ctypes.byref(link_map)) != 0 or not link_map.value:
        raise OSError("dlinfo found no link map")
    return ctypes.c_size_t.from_address(link_map.value).value  # l_addr, its first field


def redirect_imports(path: str, handle: int, targets: dict[str, int]) -> set[str]:
    """Write ``targets[name]`` into every slot the library at ``path`` imports ``name`` from.

    Parameters
    ----------
    path : str
        The library's file.
    handle : int
        Its ``dlopen`` handle (``ctypes.CDLL(path)._handle``).
    targets : dict of str to int
        Function addresses by imported symbol name.

    Returns
    -------
    set of str
        The names the library imports, whose slots now hold the targets.

    Raises
    ------
    OSError
        If the file is not an ELF64 little-endian library, its load address cannot be
        found, or a read-only slot cannot be made writable (the caller logs it and goes on).
    """
    slots, relro = _relocated_slots(path, set(targets))
    if not slots:
        return set()
    base = _load_base(handle)
    page = mmap.PAGESIZE
    libc = ctypes.CDLL(None, use_errno=True)
    for name, offsets in slots.items():
        for offset in offsets:
            address = base + offset
            protected = any(start <= offset < end for start, end in relro)
            if protected:
                first = address // page * page
                if libc.mprotect(ctypes.c_void_p(first), page, _PROT_READ | _PROT_WRITE) != 0:
                    raise OSError(ctypes.get_errno(), "mprotect of a GOT page failed")
            ctypes.c_void_p.from_address(address).value = targets[name]
            if protected:
                libc.mprotect(ctypes.c_void_p(first), page, _PROT_READ)
    return set(slots)
