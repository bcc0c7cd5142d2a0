// One-line definitions of every metric the dashboard shows (shown on hover and under chart titles).

const FIXED = {
  loss: "Training loss: forward KL(target || draft) over the draft vocabulary (plus peagle.logit_mse x the mean squared gap between the two logit rows, each centred, when set), averaged over the trained positions of all depths (the answers' tokens; every token, prompts too, with peagle.loss_positions all).",
  eval_loss: "Held-out loss: the training loss computed on the eval rows (no gradient), over the answers' tokens only whatever peagle.loss_positions says, by the weight average when optim.ema_decay is set.",
  full_acc: "Accuracy over all trained positions of all depths (draft argmax == target argmax; prompts too with peagle.loss_positions all).",
  tau_sim: "Simulated accepted draft tokens per step: tau = sum over k of prod_{j<=k} acc_j on the training batch (rows the draft learns from; prompts' tokens too with peagle.loss_positions all, which are easier to predict). Optimistic: 1 + tau is well above the measured AL, so use it to follow training, not as the AL.",
  eval_tau_sim: "Simulated accepted draft tokens per step on held-out rows (answers' tokens only; the weight average's with optim.ema_decay): sum_k prod_{j<=k} eval_acc_j. Optimistic: 1 + tau is above the measured AL (the demo draft: 1.53 vs 1.40), because serving asks depth 0 about the harder positions and never accepts a token outside the draft vocabulary; use it to compare checkpoints, not as the AL.",
  acceptance_length: "Measured acceptance length AL = 1 + accepted / drafts, pooled over the eval prompts as vLLM counts it (eval.prompt_sets; the first set, or its first eval.al_num_prompts prompts during training), by the job's evaluation engine (eval.engine: the reference decoder or vLLM).",
  speedup: "Serving speedup measured in vLLM after training: tokens/s of the verifier with the draft / tokens/s of the verifier alone, same prompts, greedy, interleaved rounds (median), at batch 1 and at a batch of all speedup prompts. Below 1 the draft makes serving slower. It only holds on the hardware named in the tooltip.",
  vllm_acceptance_length: "Acceptance length measured by a real vLLM engine serving the export (the serve check), on the first eval prompt set.",
  lr: "Learning rate of the optimizer at this step (after warmup/schedule).",
  grad_norm: "Global L2 norm of the gradients before clipping.",
  tokens_per_s: "Training throughput: supervised tokens processed per second.",
  time_fetch: "Seconds per step getting the batch: loading and packing data and, with online capture, the target model's forward pass that produces the features (usually the largest part on CPU).",
  time_forward: "Seconds per step in the forward passes (target capture + draft).",
  time_backward: "Seconds per step in the backward passes.",
  time_optimizer: "Seconds per step in the optimizer update (clip, AdamW, schedule, and the weight average with optim.ema_decay).",
  epoch: "Fraction of passes over the training rows completed.",
};

/** The prefix of the preview's metric keys (`GET /v1/meta` metric_keys.preview_prefix, peagle/spec/metrics.py). */
export const PREVIEW_PREFIX = "preview_";

/** The one-line definition of a metric key (handles acc_{d}, eval_acc_{d}, al_pos_{k}, preview_{key}). */
export function define(key) {
  if (FIXED[key]) return FIXED[key];
  if (key.startsWith(PREVIEW_PREFIX)) return `Preview (a short run on the first conversations before the main run, with a vocabulary and a draft of its own; its steps start at 1): ${define(key.slice(PREVIEW_PREFIX.length))}`;
  let m = /^acc_(\d+)$/.exec(key);
  if (m) return `Depth-${m[1]} accuracy: fraction of positions where the draft's top token at depth ${m[1]} equals the target's (unconditional, training batch: prompts' tokens too with peagle.loss_positions all).`;
  m = /^eval_acc_(\d+)$/.exec(key);
  if (m) return `Held-out depth-${m[1]} accuracy (unconditional, answers' tokens only).`;
  m = /^al_pos_(\d+)$/.exec(key);
  if (m) return `Measured acceptance rate at draft position ${m[1]}: accepted at position ${m[1]} / drafts.`;
  return key;
}

/** Short human label of a metric key. */
export function label(key) {
  const names = {
    loss: "loss", eval_loss: "eval loss", tau_sim: "tau_sim", eval_tau_sim: "eval tau_sim",
    acceptance_length: "measured AL", vllm_acceptance_length: "vLLM AL", lr: "learning rate", tokens_per_s: "tokens/s", full_acc: "full acc",
    time_fetch: "data + target", time_forward: "forward", time_backward: "backward", time_optimizer: "optimizer",
    grad_norm: "grad norm",
  };
  if (names[key]) return names[key];
  if (key.startsWith(PREVIEW_PREFIX)) return `preview ${label(key.slice(PREVIEW_PREFIX.length))}`;
  let m = /^acc_(\d+)$/.exec(key);
  if (m) return `depth ${m[1]}`;
  m = /^eval_acc_(\d+)$/.exec(key);
  if (m) return `eval depth ${m[1]}`;
  return key;
}

/**
 * The charts of the job page: title, one-line definition, and which keys they draw.
 * `keys` may be a function of all keys present (per-depth accuracy: one line per depth).
 */
export const CHARTS = [
  { id: "loss", title: "Loss", def: FIXED.loss, keys: ["loss", "eval_loss"] },
  {
    id: "acc", title: "Per-depth accuracy", def: "Unconditional accuracy of each parallel depth (one line per depth).",
    keys: (all) => all.filter((k) => /^acc_\d+$/.test(k)).sort((a, b) => +a.slice(4) - +b.slice(4)),
  },
  { id: "al", title: "tau_sim and measured AL", def: "Simulated (tau_sim) and measured (AL) acceptance length.", keys: ["tau_sim", "eval_tau_sim", "acceptance_length"] },
  { id: "lr", title: "Learning rate", def: FIXED.lr, keys: ["lr"] },
  { id: "tps", title: "Tokens/s", def: FIXED.tokens_per_s, keys: ["tokens_per_s"] },
  { id: "time", title: "Step time breakdown", def: "Seconds per step: getting the batch (data + the target's forward when capture is online), draft forward, backward, optimizer.", keys: ["time_fetch", "time_forward", "time_backward", "time_optimizer"] },
];

/**
 * The preview's chart (spec `preview`: a first curve on the first `conversations` conversations, drawn as soon
 * as its first point arrives and kept after the main training starts): its loss and accuracy.
 */
export function previewChart(conversations, prefix = PREVIEW_PREFIX) {
  return {
    id: "preview",
    title: conversations ? `Preview: first ${conversations} conversations` : "Preview",
    def: "A short run on the first conversations before the main run, so a first curve comes within minutes (its own vocabulary and draft; the main run's curves are below).",
    keys: [`${prefix}loss`, `${prefix}full_acc`],
  };
}
