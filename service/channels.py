"""Names shared by the API, the worker and the dashboard: one definition each.

- the Redis live channel of a job (`peagle:job:<id>`): the worker and the API's actions PUBLISH on it,
  the API's live hub PSUBSCRIBEs to `LIVE_PATTERN` and reads the job id back with `job_of_channel`;
- the `dataset:<id>` data-source prefix (defined in `peagle.spec`, which `peagle.builtin` also reads,
  and re-exported here for the service).

Torch-free, import-light.
"""

from __future__ import annotations

import json
from typing import Any

from peagle.spec import DATASET_PREFIX, dataset_id, dataset_ref

__all__ = ["DATASET_PREFIX", "LIVE_PATTERN", "LIVE_PREFIX", "dataset_id", "dataset_ref", "job_of_channel",
           "live_channel", "parse_wake", "wake_payload"]

#: Prefix of every job's live channel.
LIVE_PREFIX = "peagle:job:"
#: The pattern one subscription per API process listens to.
LIVE_PATTERN = f"{LIVE_PREFIX}*"


def live_channel(job_id: str) -> str:
    """Redis channel of a job's wake-ups: `peagle:job:<id>`."""
    return f"{LIVE_PREFIX}{job_id}"


def job_of_channel(channel: str | bytes) -> str | None:
    """The job id of a live channel name (None for any other channel)."""
    name = channel.decode() if isinstance(channel, bytes) else channel
    return name[len(LIVE_PREFIX):] if name.startswith(LIVE_PREFIX) else None


def wake_payload(job_id: str, seqs: tuple[int, int, int] | None, status: str) -> dict[str, Any]:
    """A live-channel message: `{"job_id", "event_seq", "metric_seq", "log_seq", "status"}` (JSON-encoded
    by the publisher); `seqs` = the job's last (event, metric, log) sequence numbers."""
    ev, me, lo = seqs if seqs is not None else (None, None, None)
    return {"job_id": job_id, "event_seq": ev, "metric_seq": me, "log_seq": lo, "status": status}


def parse_wake(payload: bytes | str) -> dict[str, Any]:
    """Decode a live-channel message (the JSON of a `wake_payload`)."""
    return dict(json.loads(payload))
