"""Names of the files a run writes that are not part of the export: the one definition.

A checkpoint (RUN/checkpoints/step_NNNNNN, docs/service.md 7) holds the vLLM export (`config.json`,
`model.safetensors`) and what only resuming needs: `training_state.pt` (fp32 weights, optimizer,
scheduler, RNG, data position; several times the export's size). The checkpoint writer
(`peagle.train.checkpoint`) writes it, and the checkpoint downloads (`api.routes.checkpoints`,
`peagle.client`) leave it out unless asked. Torch-free: the API and the service import it.
"""

from __future__ import annotations

__all__ = ["TRAINING_ONLY_FILES", "TRAINING_STATE_FILE"]

#: The resume state of a checkpoint (`torch.save` of weights, optimizer, scheduler, RNG, step, data position).
TRAINING_STATE_FILE = "training_state.pt"
#: A checkpoint's files that are not part of the export (downloads leave them out unless asked).
TRAINING_ONLY_FILES = frozenset({TRAINING_STATE_FILE})
