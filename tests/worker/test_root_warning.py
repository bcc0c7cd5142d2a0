"""`make run` as root: Celery's superuser warning is replaced by one line of ours; every other warning stays."""

from __future__ import annotations

import logging
import os
import warnings

import pytest
from celery import platforms
from celery.exceptions import SecurityWarning

from worker.app import accept_root, main_parser
from worker.run import WORKER_ARGV


def _privilege_warnings(monkeypatch: pytest.MonkeyPatch, *, then: object = None) -> list[str]:
    """Warnings of Celery's root check and of another SecurityWarning, every one shown unless filtered."""
    for name in ("getuid", "geteuid"):
        monkeypatch.setattr(os, name, lambda: 0)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        if callable(then):
            then()  # filters installed after "always" take precedence, as in the worker
        platforms.check_privileges({"json"})  # what Celery's worker runs before it starts
        warnings.warn(SecurityWarning("some other security warning"), stacklevel=1)
    return [str(w.message) for w in seen]


def test_celery_warns_a_root_worker(monkeypatch: pytest.MonkeyPatch) -> None:
    seen = _privilege_warnings(monkeypatch)
    assert any("superuser privileges" in m for m in seen) and "some other security warning" in seen


def test_accept_root_hides_only_the_superuser_warning(monkeypatch: pytest.MonkeyPatch,
                                                      caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="worker.app"):
        seen = _privilege_warnings(monkeypatch, then=accept_root)
    assert not any("superuser privileges" in m for m in seen)
    assert "some other security warning" in seen  # not a blanket filter
    assert any("root" in r.getMessage() for r in caplog.records)  # said once, in our words


def test_make_run_starts_the_worker_with_accept_root() -> None:
    assert WORKER_ARGV[:2] == ["-m", "worker"]
    assert main_parser().parse_args(WORKER_ARGV[2:]).accept_root is True
    assert main_parser().parse_args([]).accept_root is False  # docker compose: the unprivileged user
