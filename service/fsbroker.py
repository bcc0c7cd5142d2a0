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

Selected by `service.queue.celery_config` (`broker_transport`) on the API and the worker alike.
File names, their order and the folder options are kombu's.
"""

from __future__ import annotations

import contextlib
import logging
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

    def _done_with(self, claimed: Path, name: str) -> None:
        if self.store_processed:
            with contextlib.suppress(OSError):
                shutil.move(claimed, Path(self.processed_folder) / name)
                return
        claimed.unlink(missing_ok=True)


class Transport(filesystem.Transport):
    """kombu's filesystem transport with `Channel` above."""

    Channel = Channel
