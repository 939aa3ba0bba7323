"""Checkpoint files that are complete under their final name, or absent: never cut short.

Lightning's ``TorchCheckpointIO`` writes a local checkpoint through an fsspec transaction: the
bytes go to a temporary file in the system's temporary directory, which is then *moved* to the
checkpoint's name. Across filesystems (``/tmp`` on another disk, a tmpfs) that move is a copy,
and a copy cut short (a full disk, a killed process) leaves a truncated file under the final
name, e.g. a 12 KiB ``epoch=1-step=8.ckpt`` of ~400 KiB. Resuming from it failed with
``OSError: [Errno 22] Invalid argument``, naming no file.

:class:`AtomicCheckpointIO` (what ``TunedDDPStrategy`` and ``HybridParallelStrategy`` use unless
given their own ``CheckpointIO``) writes a local checkpoint to a temporary file *in the
checkpoint's own directory*, ``fsync``\\ s it, renames it over the final name with
``os.replace`` (atomic within one filesystem) and ``fsync``\\ s the directory, so that the name
holds either the previous file or the complete new one, also after a power loss. A write that
fails removes its temporary file; a process killed mid-write may leave a hidden
``.NAME.XXXXXXXX.tmp`` beside it, never a partial ``NAME``. Remote paths (``s3://``, ``gs://``,
any non-local fsspec URL) go through Lightning's own writer, as before.

**A ``CheckpointIO`` of your own stays yours.** ``strategy.checkpoint_io`` is the object you gave
(``TunedDDPStrategy(checkpoint_io=...)`` or ``Trainer(plugins=[...])``); only when none was given
does the strategy make an :class:`AtomicCheckpointIO`. When yours is a ``TorchCheckpointIO``
whose own writer is in use (its ``save_checkpoint`` not overridden: it writes exactly the path it
is given), the strategy's ``save_checkpoint`` gives it the temporary path and renames the result
as above (:func:`atomic_rename_target`, :func:`replace_atomically`), and a damaged file it loads is
named as below. Any other ``CheckpointIO`` (one that writes elsewhere, a directory, a remote
store, ``AsyncCheckpointIO``) writes as it writes: its atomicity is its own.

On load, a file that cannot be read is inspected: one that is not a complete zip archive (what
``torch.save`` writes) or whose contents fail their checksums raises
:class:`IncompleteCheckpointError`, naming the file and what is wrong with it.
"""

from __future__ import annotations

import os
import uuid
import zipfile
from typing import IO, Any, Callable, Optional

import torch
from fsspec.core import url_to_fs  # type: ignore[import-untyped]
from fsspec.implementations.local import LocalFileSystem  # type: ignore[import-untyped]
from lightning.fabric.plugins import CheckpointIO, TorchCheckpointIO
from typing_extensions import override

from lightning_mgpu._compat.lightning import PathLike

_CHUNK = 1 << 22

__all__ = [
    "AtomicCheckpointIO",
    "IncompleteCheckpointError",
    "atomic_rename_target",
    "inspect_checkpoint_file",
    "load_naming_damage",
    "names_damaged_files",
    "replace_atomically",
]


class IncompleteCheckpointError(RuntimeError):
    """A checkpoint file that was cut short or damaged: the message names the file and the damage."""


def _local_path(path: PathLike) -> Optional[str]:
    """The local filesystem path of ``path`` (``file://`` URLs included), or None for a remote URL."""
    fs, local = url_to_fs(str(path))
    return local if isinstance(fs, LocalFileSystem) else None


def _temporary_beside(path: str) -> tuple[str, str]:
    """(directory, a fresh hidden temporary name in it) for ``path``; the directory is created."""
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    return directory, os.path.join(directory, f".{os.path.basename(path)}.{uuid.uuid4().hex[:8]}.tmp")


def _remove_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def write_atomically(path: str, write: Callable[[IO[bytes]], None]) -> None:
    """Create or replace the file ``path`` with what ``write(file)`` writes, atomically (see the module docstring)."""
    directory, temporary = _temporary_beside(path)
    # O_EXCL: never reuse someone else's file; mode 0o666 & ~umask, as an ordinary open() would give
    descriptor = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with os.fdopen(descriptor, "wb") as file:
            write(file)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temporary, path)
    except BaseException:
        _remove_quietly(temporary)
        raise
    _fsync_directory(directory)


def replace_atomically(path: str, write_to: Callable[[str], None]) -> None:
    """Create or replace the file ``path`` with the file ``write_to(temporary)`` writes at the path it is given
    (beside ``path``, hidden), atomically: synced, renamed over ``path``, the directory synced. A write that fails
    (or writes no file there) leaves ``path`` as it was and no temporary file."""
    directory, temporary = _temporary_beside(path)
    try:
        write_to(temporary)
        descriptor = os.open(temporary, os.O_RDONLY)  # FileNotFoundError: nothing was written there
        try:
            os.fsync(descriptor)
        finally:
            os.close(descriptor)
        os.replace(temporary, path)
    except BaseException:
        _remove_quietly(temporary)
        raise
    _fsync_directory(directory)


def atomic_rename_target(io: CheckpointIO, path: PathLike, storage_options: Optional[Any] = None) -> Optional[str]:
    """The local path a strategy should write through :func:`replace_atomically` when saving with ``io``, or None.

    Only for a ``TorchCheckpointIO`` whose own ``save_checkpoint`` is in use (a user's
    ``TorchCheckpointIO()``, kept as given): it writes exactly the path it is handed. None for
    :class:`AtomicCheckpointIO` (atomic by itself), any other ``CheckpointIO``, ``storage_options``
    and remote paths."""
    if storage_options is not None or not _uses_torch_checkpoint_io(io, "save_checkpoint"):
        return None
    return _local_path(path)


def names_damaged_files(io: CheckpointIO) -> bool:
    """Whether a strategy should check a file ``io`` failed to load (:func:`load_naming_damage`): a
    ``TorchCheckpointIO`` whose own ``load_checkpoint`` is in use (:class:`AtomicCheckpointIO` checks itself)."""
    return _uses_torch_checkpoint_io(io, "load_checkpoint")


def _uses_torch_checkpoint_io(io: CheckpointIO, method: str) -> bool:
    return isinstance(io, TorchCheckpointIO) and getattr(type(io), method) is getattr(TorchCheckpointIO, method)


def _fsync_directory(directory: str) -> None:
    """Make the rename itself durable (a no-op where directories cannot be opened, e.g. Windows)."""
    try:
        descriptor = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(descriptor)
    except OSError:
        pass
    finally:
        os.close(descriptor)


def inspect_checkpoint_file(path: PathLike, *, check_contents: bool = True) -> Optional[str]:
    """What is wrong with the checkpoint file ``path``, in words, or None when it looks whole.

    Cheap checks first (size, the zip archive's central directory, every member inside the
    file); with ``check_contents`` also every member's CRC-32 checksum, which ``torch.load`` does
    not verify: a flipped byte in a tensor would otherwise load silently. That reads the whole
    file once more (from the page cache, just after ``torch.load`` read it). Members stored with
    a CRC of 0 are not checked (``torch.serialization.set_crc32_options(False)`` writes them so).
    """
    fs, local = url_to_fs(str(path))
    try:
        size = int(fs.size(local))
    except OSError:
        return None  # missing or unreadable: the original error says so better
    if size == 0:
        return "it is empty (0 bytes)"
    try:
        with fs.open(local, "rb") as file, zipfile.ZipFile(file) as archive:
            members = archive.infolist()
            for member in members:
                if member.header_offset + member.compress_size > size:
                    return f"it is cut short ({size:,} bytes): member {member.filename!r} runs past its end"
            if check_contents:
                for member in members:
                    if member.CRC == 0:
                        continue
                    with archive.open(member) as content:
                        while content.read(_CHUNK):
                            pass
    except zipfile.BadZipFile as error:
        if "CRC" in str(error):
            return f"its bytes were damaged after writing ({error})"
        return f"it is not a complete zip archive, as torch.save writes ({size:,} bytes; its end is missing)"
    except (OSError, EOFError, ValueError) as error:
        return f"it cannot be read as a zip archive ({size:,} bytes: {error})"
    return None


def _is_unpickling_refusal(error: BaseException) -> bool:
    """``pickle.UnpicklingError`` (by name: the package imports no pickle module, see test_reliability_input)."""
    return any(cls.__name__ == "UnpicklingError" for cls in type(error).__mro__)


class AtomicCheckpointIO(TorchCheckpointIO):
    """Lightning's ``TorchCheckpointIO``, writing local files atomically and naming a damaged file on load.

    Args:
        verify_checksums: after loading a local file, check every member's CRC-32
            (:func:`inspect_checkpoint_file`); ``torch.load`` itself does not.
    """

    def __init__(self, *, verify_checksums: bool = True) -> None:
        super().__init__()
        self.verify_checksums = verify_checksums

    @override
    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: PathLike, storage_options: Optional[Any] = None
    ) -> None:
        local = _local_path(path)
        if local is None or storage_options is not None:  # remote (or an error TorchCheckpointIO words)
            super().save_checkpoint(checkpoint, path, storage_options=storage_options)
            return
        write_atomically(local, lambda file: torch.save(checkpoint, file))

    @override
    def load_checkpoint(
        self,
        path: PathLike,
        map_location: Optional[Callable[..., Any]] = lambda storage, loc: storage,
        weights_only: Optional[bool] = None,
    ) -> dict[str, Any]:
        load = super().load_checkpoint
        return load_naming_damage(
            lambda: load(path, map_location=map_location, weights_only=weights_only),
            path,
            verify_checksums=self.verify_checksums,
        )


def load_naming_damage(load: Callable[[], dict[str, Any]], path: PathLike, *, verify_checksums: bool) -> dict[str, Any]:
    """``load()`` (a checkpoint read from ``path``); a file that fails to load, or whose checksums fail
    (``verify_checksums``, local files), raises :class:`IncompleteCheckpointError` naming it and its damage."""
    try:
        checkpoint = load()
    except FileNotFoundError:
        raise
    except Exception as error:
        # An unpickling refusal (weights_only) of a whole file stays what it is; reading every
        # byte for checksums is only worth it when the error could come from damaged bytes.
        damage = inspect_checkpoint_file(path, check_contents=not _is_unpickling_refusal(error))
        if damage is None:
            raise
        raise _damaged(path, damage, f" (reading it failed with {type(error).__name__}: {error})") from error
    if verify_checksums and _local_path(path) is not None:
        damage = inspect_checkpoint_file(path)
        if damage is not None:
            raise _damaged(path, damage, "")
    return checkpoint


def _damaged(path: PathLike, damage: str, detail: str) -> IncompleteCheckpointError:
    return IncompleteCheckpointError(
        f"checkpoint {path} is incomplete or damaged: {damage}. It was cut short or altered after being written "
        f"(a full disk, a killed process, an interrupted copy, a failing disk). Resume from an earlier "
        f"checkpoint.{detail[:300]}"
    )
