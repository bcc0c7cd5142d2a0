"""No job route names the host, a process id or the kernel build (issue 46, item 7).

The worker stores provenance on the job (`worker/provenance.py`: `platform.platform()`, the kernel build in
it) and the trainer's `provenance.json` (`peagle.pipeline`: `platform.node()`, `os.getpid()`). The job's
owner reads the job; the task list already labels workers (`w-` + 8 hex digits). Details keep what a user
needs (CPU kind, GPU model and count, the hardware class, versions) and label a host the same way.
"""

from __future__ import annotations

import json
from typing import Any

from fastapi.testclient import TestClient

from api.records import public_record, worker_label
from service.db.models import JobEvent
from service.db.session import session_scope

HOST = "gpu-node-17.corp.internal"
PID = 48213
KERNEL = "5.15.0-1051-aws"
PLATFORM = f"Linux-{KERNEL}-x86_64-with-glibc2.35"
GPU = "NVIDIA H100 80GB HBM3"
CPU = "Intel(R) Xeon(R) Platinum 8480+"

PROVENANCE = {
    "worker": {"platform": PLATFORM, "python": "3.11.9", "hardware_class": "cuda-2gpu", "attempt": 0,
               "gpus": [{"index": "0", "name": GPU, "memory_total": "81559 MiB", "driver": "550.54.15"},
                        {"index": "1", "name": GPU, "memory_total": "81559 MiB", "driver": "550.54.15"}],
               "cuda_visible_devices": "0,1", "argv": ["python", "-m", "peagle", "train", "<run>/job_spec.json"]},
    "trainer": {"host": HOST, "platform": PLATFORM, "pid": PID, "device": "cuda:0", "cuda_device": GPU,
                "python": "3.11.9", "argv": ["peagle", "train", f"--note=started by {HOST}"],
                "hardware": {"device": "cuda", "cpu": CPU, "cpu_count": 32, "gpu": GPU, "gpu_count": 2,
                             "hostname": HOST, "kernel": KERNEL, "ppid": 1}},
}
SECRETS = (HOST, "gpu-node-17", str(PID), KERNEL)


def _leaks(body: Any) -> list[str]:
    text = json.dumps(body)
    return [s for s in SECRETS if s in text]


def _stored(client: TestClient, sim: Any, headers: dict[str, str], submit: Any) -> dict[str, Any]:
    job = submit(client, headers)
    sim.set(job["id"], status="running", provenance=PROVENANCE)
    return job


def test_job_details_and_lists_name_no_host_pid_or_kernel(client: TestClient, sim: Any, alice: dict,
                                                          submit: Any) -> None:
    job = _stored(client, sim, alice, submit)
    answers = {
        "details": client.get(f"/v1/jobs/{job['id']}", headers=alice),
        "list": client.get("/v1/jobs", headers=alice),
        "list (filtered)": client.get("/v1/jobs", params={"status": "running"}, headers=alice),
        "pause": client.post(f"/v1/jobs/{job['id']}/pause", headers=alice),
        "cancel": client.post(f"/v1/jobs/{job['id']}/cancel", headers=alice),
        "events": client.get(f"/v1/jobs/{job['id']}/events", headers=alice),
        "tasks": client.get(f"/v1/jobs/{job['id']}/tasks", headers=alice),
    }
    for name, r in answers.items():
        assert r.status_code == 200, (name, r.text)
        assert _leaks(r.json()) == [], (name, _leaks(r.json()))
    prov = answers["details"].json()["provenance"]
    # what a user needs stays: the GPU model and count, the CPU kind, the hardware class, versions, the OS
    assert [g["name"] for g in prov["worker"]["gpus"]] == [GPU, GPU]
    assert prov["worker"]["hardware_class"] == "cuda-2gpu" and prov["worker"]["python"] == "3.11.9"
    hw = prov["trainer"]["hardware"]
    assert (hw["cpu"], hw["cpu_count"], hw["gpu"], hw["gpu_count"]) == (CPU, 32, GPU, 2)
    assert prov["trainer"]["cuda_device"] == GPU
    assert prov["worker"]["platform"] == prov["trainer"]["platform"] == "Linux x86_64"
    # the host is the task list's label of it; pids are gone
    assert prov["trainer"]["host"] == worker_label(HOST) and hw["hostname"] == worker_label(HOST)
    assert "pid" not in prov["trainer"] and "ppid" not in hw and "kernel" not in hw
    assert prov["trainer"]["argv"][-1] == f"--note=started by {worker_label(HOST)}"


def test_public_record_is_pure_and_keeps_other_values() -> None:
    data = {"a": [1, 2.5, None, True, "x"], "platform": "Darwin-23.4.0-arm64-arm-64bit", "pid": 5}
    out = public_record(data)
    assert out == {"a": [1, 2.5, None, True, "x"], "platform": "Darwin arm64"}
    assert data["pid"] == 5  # the input is untouched
    assert public_record(None) is None
    assert public_record({"platform": "Windows-10-10.0.19045-SP0"}) == {"platform": "Windows"}


def test_the_events_page_names_no_host_pid_or_kernel(client: TestClient, sim: Any, alice: dict,
                                                     submit: Any) -> None:
    job = _stored(client, sim, alice, submit)
    with session_scope(sim.sessions) as s:  # an event whose data carries the machine (as provenance does)
        seq = sim.job(job["id"]).event_seq + 1
        s.add(JobEvent(job_id=job["id"], seq=seq, kind="started", message="attempt 0 started",
                       data={"provenance": PROVENANCE["trainer"]}))
    sim.set(job["id"], event_seq=seq)
    r = client.get(f"/v1/jobs/{job['id']}/events", headers=alice)
    assert r.status_code == 200 and r.json()["data"], r.text
    assert _leaks(r.json()) == [], _leaks(r.json())
