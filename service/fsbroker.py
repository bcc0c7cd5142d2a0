"""The embedded broker's transport: kombu's `filesystem://` transport, with a message that is never seen
half-written and a consumer that never dies of one.

kombu's own `_put` creates the message file under its final name and then writes it, and its `_get`
moves any file with that name and reads it. A worker polling between the two (two workers on one queue,
or a reaper re-sending) reads an empty file, fails to decode it and stops with an unrecoverable error,
and the message is gone. Here a message is written under a hidden name and renamed to its final name
when complete (`os.replace`, atomic in one directory), and a consumer claims a file by renaming it
inside the same directory (atomic: of two consumers exactly one wins) before reading it. A message that
still does not decode (a file damaged outside the service) is logged and dropped; the reaper re-sends
a queued job whose message is not in the broker.

kombu's exchange tables (`control/<exchange>.exchange`, which queues an exchange routes to) have the same
race: its `_queue_bind` creates a missing table file, and only then locks it and writes it. A second
worker starting at the same moment (both declare their queues) finds the file, locks it first, reads it
empty and dies of the JSONDecodeError. Here the file is opened (created if missing) and locked before
anything reads it, and an empty table file reads as no bindings yet.

Selected by `service.queue.celery_config` (`broker_transport`) on the API and the worker alike.
File names, their order and the folder options are kombu's.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import uuid
from pathlib import Path
from queue import Empty
from time import monotonic
from typing import Any

from kombu.exceptions import ChannelError
from kombu.transport import filesystem
from kombu.utils.encoding import bytes_to_str, str_to_bytes
from kombu.utils.json import dumps, loads

from peagle.fileio import atomic_write_bytes

__all__ = ["Channel", "Transport"]

log = logging.getLogger(__name__)


class Channel(filesystem.Channel):
    """`filesystem.Channel` with an atomic put and an atomic, crash-free get."""

    # kombu's filesystem Channel names the argument `payload`, its abstract base `message`: one must differ
    def _put(self, queue: Any, payload: Any, **kwargs: Any) -> Any:  # type: ignore[override]
        """Write the message under a hidden name (`peagle.fileio`), then rename it to kombu's `<ms>_<uuid>.<queue>.msg`."""
        final = Path(self.data_folder_out) / f"{round(monotonic() * 1000)}_{uuid.uuid4()}.{queue}.msg"
        try:
            atomic_write_bytes(final, str_to_bytes(dumps(payload)), durable=True)
        except OSError as exc:
            raise ChannelError(f"Cannot add file {final.name!r} to directory {str(final.parent)!r}: {exc}") from exc

    def _get(self, queue: Any, timeout: Any = None) -> Any:
        """The oldest complete message of `queue`; `queue.Empty` when there is none."""
        wanted = f"{queue}.msg"
        folder = Path(self.data_folder_in)
        for name in sorted(p.name for p in folder.iterdir()):
            if name.partition(".")[2] != wanted:
                continue
            claimed = folder / f".got-{uuid.uuid4()}"
            try:
                (folder / name).rename(claimed)
            except OSError:
                continue  # another consumer took it
            try:
                payload = claimed.read_bytes()
            except OSError as exc:
                raise ChannelError(f"Cannot read file {name!r} from queue.") from exc
            finally:
                self._done_with(claimed, name)
            try:
                return loads(bytes_to_str(payload))
            except ValueError:
                log.warning("broker: dropped message %s of queue %s: not valid JSON (%d bytes)", name, queue,
                            len(payload))
        raise Empty()

    def get_table(self, exchange: Any) -> list[Any]:
        """The exchange's bindings (`exchange_queue_t`); a table file just created and not yet written is none."""
        file = self._exchange_file(exchange)
        try:
            with file.open("rb") as f:
                filesystem.lock(f, filesystem.LOCK_SH)
                try:
                    data = f.read()
                finally:
                    filesystem.unlock(f)
        except FileNotFoundError:
            return []
        except OSError as exc:
            raise ChannelError(f"Cannot open {file}") from exc
        return _table(data)

    def _queue_bind(self, exchange: Any, routing_key: Any, pattern: Any, queue: Any) -> None:
        """Add a binding to the exchange's table, read and written under one exclusive lock taken before
        anything reads it (the module docstring: kombu's reads a table another worker is still creating)."""
        file = self._exchange_file(exchange)
        self.control_folder.mkdir(exist_ok=True)
        entry = filesystem.exchange_queue_t(routing_key or "", pattern or "", queue or "")
        try:
            fd = os.open(file, os.O_RDWR | os.O_CREAT, 0o644)
            with os.fdopen(fd, "rb+", buffering=0) as f:
                filesystem.lock(f, filesystem.LOCK_EX)
                try:
                    queues = _table(f.read())
                    if entry not in queues:
                        queues.insert(0, entry)
                        f.seek(0)
                        f.truncate()
                        f.write(str_to_bytes(dumps(queues)))
                finally:
                    filesystem.unlock(f)
        except OSError as exc:
            raise ChannelError(f"Cannot open {file}") from exc

    def _done_with(self, claimed: Path, name: str) -> None:
        if self.store_processed:
            with contextlib.suppress(OSError):
                shutil.move(claimed, Path(self.processed_folder) / name)
                return
        claimed.unlink(missing_ok=True)


def _table(data: bytes) -> list[Any]:
    """An exchange table file's bindings; an empty file (being created) has none."""
    return [filesystem.exchange_queue_t(*q) for q in loads(bytes_to_str(data))] if data.strip() else []


class Transport(filesystem.Transport):
    """kombu's filesystem transport with `Channel` above."""

    Channel = Channel
