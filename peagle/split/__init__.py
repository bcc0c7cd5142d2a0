"""A job split over engine workers (`resources.engine`, issue 37): the trainer and the engine workers share
only the job's folder, and everything they exchange is a file there (docs/service.md 9).

- `protocol`: the folders, the file names, the capture and regeneration plans, the release and done
  markers, what is pending, the trainer's wait, the engine a plan needs (`engine_key`). Torch-free
  (stdlib, `peagle.fileio`, `peagle.errors`): the trainer worker's dispatcher (`worker.dispatch`) imports
  only this, and every side below imports it.

Like `peagle.engine`, this room sits below the packages that use it; the sides live with the code they
drive, so that no import circle joins the packages (tests/unit/foundation/test_import_cycles.py):

- the capture side, `peagle.target.remote`: `write_plan`, `run_capture_chunk` / `run_eval_chunk` (engine
  worker), `RemoteFeatureSource` (the trainer's reader, sharing `peagle.target.sources.load_micro_batch`
  with the streaming and offline sources) and the engines an engine worker keeps warm;
- the regeneration side, `peagle.data.remote_regen`: `run_regen_chunk` (engine worker), `wait_for_regen`
  and `merge_chunks` (trainer);
- the service sides: `worker.dispatch` (sends chunks), `worker.engine_task` (runs one), and
  `service.db.engine_tasks` (their rows).

Nothing is imported here, so ``import peagle.split.protocol`` never loads torch.
"""
