"""The checkpoint a resume starts from, on every machine of a run.

Only the main process writes checkpoints (session.py), into its own output_dir. When the machines
of a run share that folder (a network filesystem), every process reads the same checkpoint; when
each machine has a folder of its own, the others hold none. On resume the main process chooses the
checkpoint (the newest whole one that fits the run: safety/checkpoint.py `find_resumable`) and says
which, with a fingerprint of each of its files (`manifest`: name, size, a digest of its first and
last MiB); a machine whose output_dir lacks that checkpoint, or holds one of that name that differs,
receives the main process's files over the process group (in chunks of CHUNK bytes, the main
process to that machine's first process, which writes them as the main process writes a checkpoint:
into a temporary folder made durable and renamed into place). Then every process loads the same
checkpoint, from its own folder; the run goes on as on one machine.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

import torch
from accelerate.utils import broadcast_object_list, gather_object

from vlmrl.errors import VlmrlError, one_line
from vlmrl.safety.checkpoint import make_durable
from vlmrl.safety.faults import any_process

CHUNK = 64 * 2**20
"""Bytes sent in one broadcast: a checkpoint of many GB goes in pieces, never whole in memory."""

PROBE = 2**20
"""Bytes read from each end of a file for its digest: two checkpoints of the same step and sizes
from different runs differ there (the weights' first and last tensors), and reading a 28 GB
checkpoint whole on every resume would not be cheap."""

Manifest = list[tuple[str, int, str]]
"""(path inside the checkpoint folder, size in bytes, digest of its first and last PROBE bytes), sorted."""


def manifest(folder: Path) -> Manifest | None:
    """The fingerprint of every file under checkpoint `folder`, or None when there is no such folder."""
    if not folder.is_dir():
        return None
    files = []
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        size = path.stat().st_size
        digest = hashlib.sha256()
        with path.open("rb") as handle:
            digest.update(handle.read(PROBE))
            if size > PROBE:
                handle.seek(max(PROBE, size - PROBE))
                digest.update(handle.read(PROBE))
        files.append((path.relative_to(folder).as_posix(), size, digest.hexdigest()))
    return files


def checkpoint_everywhere(accelerator, run_dir: Path, chosen: Path | None) -> Path | None:
    """The folder, in this process's `run_dir`, of the checkpoint the main process `chosen` (None on
    the other processes; every process calls this). A machine whose folder lacks it receives it from
    the main process first. None on every process when the main process chose none."""
    offer = broadcast_object_list([(chosen.name, manifest(chosen)) if chosen is not None else None])[0]
    if offer is None:
        return None
    name, files = offer
    folder = Path(run_dir) / "checkpoints" / name
    lacks = not accelerator.is_main_process and manifest(folder) != files
    writers = gather_object([accelerator.process_index] if lacks and accelerator.is_local_main_process else [])
    if writers:
        failure = send(accelerator, chosen, folder, files, sorted(writers))
        if any_process(accelerator, failure is not None):
            raise VlmrlError(failure or f"another machine could not write checkpoint {name} the main process "
                             "sent it (see its error)")
    accelerator.wait_for_everyone()  # the machine's first process wrote it: the others read it now
    whole = not lacks or manifest(folder) == files
    if any_process(accelerator, not whole):
        raise VlmrlError(f"checkpoint {folder} differs from the main process's {name} after it was sent" if not whole
                         else f"another machine's copy of checkpoint {name} differs from the main process's after "
                         "it was sent (see its error)")
    return folder


def send(accelerator, chosen: Path | None, folder: Path, files: Manifest, writers: list[int]) -> str | None:
    """The main process's files of checkpoint `chosen` broadcast to the processes `writers`, which
    write them into `folder` (each machine's own). Every process calls this (the group is made by all).
    Returns this process's failure to write, in words, or None."""
    group = torch.distributed.new_group([0, *writers])
    rank = accelerator.process_index
    if rank != 0 and rank not in writers:
        return None
    tmp = folder.parent / f".tmp_{folder.name}"
    failure = None
    if rank != 0:
        try:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        except OSError as error:
            failure = f"cannot write checkpoint {folder.name} into {folder.parent}: {one_line(error)}"
    device = accelerator.device
    for relative, size, _ in files:
        source = (chosen / relative).open("rb") if rank == 0 else None
        target = None
        if rank != 0 and failure is None:
            try:
                (tmp / relative).parent.mkdir(parents=True, exist_ok=True)
                target = (tmp / relative).open("wb")
            except OSError as error:
                failure = f"cannot write checkpoint {folder.name} into {folder.parent}: {one_line(error)}"
        for start in range(0, size, CHUNK):
            length = min(CHUNK, size - start)
            if source is not None:
                piece = torch.frombuffer(bytearray(source.read(length)), dtype=torch.uint8).to(device)  # (length,)
            else:
                piece = torch.empty(length, dtype=torch.uint8, device=device)  # (length,)
            torch.distributed.broadcast(piece, src=0, group=group)
            if target is not None:
                try:
                    target.write(piece.cpu().numpy().tobytes())
                except OSError as error:
                    failure = f"cannot write checkpoint {folder.name} into {folder.parent}: {one_line(error)}"
                    target.close()
                    target = None
        for handle in (source, target):
            if handle is not None:
                handle.close()
    if rank != 0 and failure is None:
        try:
            make_durable(tmp)
            shutil.rmtree(folder, ignore_errors=True)
            os.replace(tmp, folder)
        except OSError as error:
            failure = f"cannot write checkpoint {folder.name} into {folder.parent}: {one_line(error)}"
    if rank == 0:
        size = sum(size for _, size, _ in files)
        print(f"resume: sent checkpoint {folder.name} ({size / 2**20:.1f} MiB) to {len(writers)} process(es) "
              "whose output_dir lacks it", flush=True)
    return failure
