"""`python -m worker ...` runs one Celery training worker (see `worker.app.main`)."""

from worker.app import main

raise SystemExit(main())
