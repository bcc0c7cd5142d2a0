"""Chat data -> training rows: ingestion (`formats`, torch-free), templating + assistant masks (`template`,
torch-free), packing + the shift of docs/decisions.md decision 1 (`packing`), draft vocab + mask token (`vocab`), response
regeneration (`regenerate`) and the one entry the pipeline calls (`prepare.prepare_data`).

Nothing is imported here, so ``python -m peagle.data.formats`` (the API's dataset check) never loads torch.
"""
