"""Every wire key and run-config key of the federation, in one place.

Three kinds of names live here:

* **Records** of a Flower ``RecordDict`` (what travels in a message).
* **Contribution keys**: the flat, summable ``ArrayRecord`` a client sends back.
  Every value is a float32 array; the server (or a secure aggregator) only ever
  needs the element-wise SUM over clients. Keys are namespaced by prefix:

  - ``delta/<adapter tensor>``: ``weight * (local - global)`` of one adapter tensor.
  - ``ctrl/<adapter tensor>``: SCAFFOLD's control-variate delta ``c_i+ - c_i`` (unweighted).
  - ``meta/weight``: the client's aggregation weight, shape ``(1,)``.
  - ``meta/count``: 1.0 for a contributing client, 0.0 for one whose work the strategy drops.

  ``delta/`` and ``ctrl/`` keys are SENSITIVE (a DP mechanism clips their joint L2
  norm per client and noises their sum); ``meta/`` keys are PUBLIC (they reveal
  participation and, with example weighting, dataset size; DP runs use uniform
  weighting so ``meta/weight`` equals ``meta/count``).
* **Config keys**: the hyphenated names of ``[tool.flwr.app.config]``, of the
  scenario TOML files and of the ``ConfigRecord`` sent with each train message.
"""

from __future__ import annotations

from typing import Final

# ---------------------------------------------------------------- records in a RecordDict
REC_GLOBAL: Final = "global"  # ArrayRecord, server -> client: global adapter tensors
REC_STRATEGY: Final = "strategy"  # ArrayRecord, server -> client: strategy state (SCAFFOLD's c)
REC_CONFIG: Final = "config"  # ConfigRecord, server -> client: the client-side configuration
REC_CONTRIB: Final = "contribution"  # ArrayRecord, client -> server: the summable contribution
REC_METRICS: Final = "metrics"  # MetricRecord, client -> server: loss, examples, timings

# ---------------------------------------------------------------- contribution keys
PREFIX_DELTA: Final = "delta/"
PREFIX_CONTROL: Final = "ctrl/"
PREFIX_META: Final = "meta/"
KEY_WEIGHT: Final = "meta/weight"
KEY_COUNT: Final = "meta/count"
SENSITIVE_PREFIXES: Final = (PREFIX_DELTA, PREFIX_CONTROL)

# ---------------------------------------------------------------- metric keys (client replies)
MET_TRAIN_LOSS: Final = "train-loss"
MET_EVAL_LOSS: Final = "eval-loss"
MET_NUM_EXAMPLES: Final = "num-examples"
MET_LOCAL_STEPS: Final = "local-steps"
MET_COMPLETED: Final = "completed-fraction"
MET_TRAIN_SECONDS: Final = "train-seconds"
MET_PARTITION: Final = "partition-id"
MET_MODEL_LOADS: Final = "model-loads"  # base-model loads in this worker so far (cache check)
MET_CALLS: Final = "worker-calls"  # ClientApp calls served by this worker so far

# ---------------------------------------------------------------- node config (flower-supernode --node-config)
NODE_PARTITION_ID: Final = "partition-id"
NODE_NUM_PARTITIONS: Final = "num-partitions"

# ---------------------------------------------------------------- run / client config keys
CFG_ROUNDS: Final = "num-server-rounds"
CFG_STRATEGY: Final = "strategy"  # fedavg | fedprox | scaffold
CFG_SERVER_LR: Final = (
    "server-lr"  # server step (plain x, FedAvgM lr, FedOpt eta); 0: optimizer's own
)
CFG_SERVER_OPTIMIZER: Final = "server-optimizer"  # none | fedavgm | fedadam | fedyogi | fedadagrad
CFG_SERVER_MOMENTUM: Final = "server-momentum"  # FedAvgM's momentum
CFG_SERVER_BETA1: Final = "server-beta1"  # FedAdam / FedYogi first-moment decay
CFG_SERVER_BETA2: Final = "server-beta2"  # FedAdam / FedYogi second-moment decay
CFG_SERVER_TAU: Final = "server-tau"  # FedOpt's adaptivity floor under sqrt(v)
CFG_PROXIMAL_MU: Final = "proximal-mu"
CFG_WEIGHTING: Final = "weighting"  # examples | uniform
CFG_ACCEPT_PARTIAL: Final = "accept-partial-work"
CFG_FRACTION_TRAIN: Final = "fraction-train"
CFG_MIN_TRAIN_NODES: Final = "min-train-nodes"
CFG_MIN_AVAILABLE_NODES: Final = "min-available-nodes"
CFG_OVER_SELECTION: Final = "over-selection"  # sample ceil(K (1 + x)) nodes to get K reports
CFG_TARGET_REPORTS: Final = "target-reports"  # K, the reports a round wants (train config)
CFG_ROUND_TIMEOUT: Final = "round-timeout"
CFG_SEED: Final = "seed"
CFG_SERVER_ROUND: Final = "server-round"
CFG_RUN_ID: Final = "run-id"  # random id of a fresh run; namespaces client state on disk
# Client state is committed only when the server accepted the contribution that produced it:
# for each sampled client, the last round whose contribution the server accepted (0 = none yet).
# Keyed by partition id, which survives node restarts (node ids do not).
CFG_COMMITTED_PARTITIONS: Final = "committed-partitions"  # list[int]: partition ids
CFG_COMMITTED_ROUNDS: Final = "committed-rounds"  # list[int]: the accepted round of each
# The same inside a plain Flower ServerApp (fedge strategies' configure_train), keyed by the
# Flower node id (a Flower app has no partition ids the strategy could know).
CFG_COMMITTED_NODES: Final = "committed-nodes"  # list[int]: node ids
CFG_COMMITTED_NODE_ROUNDS: Final = "committed-node-rounds"  # list[int]: the accepted round of each

CFG_MODEL: Final = "model"  # a model dir or hub id, or "zoo:<preset>"
CFG_DISTILL_TEACHER: Final = "distill-teacher"  # model dir: clients distil from it (realignment)
CFG_DISTILL_TEMPERATURE: Final = "distill-temperature"  # softmax temperature of that distillation
CFG_DISTILL_GENERATE: Final = "distill-generate"  # teacher's greedy tokens per window (0: none)
CFG_MODEL_PATH: Final = "model-path"  # server-resolved model dir, used when it exists here
CFG_PARTITION_SCHEME: Final = "partition-scheme"  # natural | iid | dirichlet
CFG_NUM_PARTITIONS: Final = "num-partitions"
CFG_DIRICHLET_ALPHA: Final = "dirichlet-alpha"
CFG_MAX_CHARS_PER_CLIENT: Final = "max-chars-per-client"
CFG_DATA_SOURCE: Final = "data-source"  # "" = stdlib corpus, else a directory of text files
CFG_DATA_KIND: Final = "data-kind"  # text (token streams) | instructions (fedge.data.instructions)
DATA_KINDS: Final = ("text", "instructions")

CFG_LORA_R: Final = "lora-r"
CFG_LORA_ALPHA: Final = "lora-alpha"
CFG_LORA_DROPOUT: Final = "lora-dropout"
CFG_LORA_TARGETS: Final = "lora-target-modules"  # comma separated
CFG_LOCAL_STEPS: Final = "local-steps"
CFG_BATCH_SIZE: Final = "batch-size"
CFG_SEQ_LEN: Final = "seq-len"
CFG_LR: Final = "lr"
CFG_MAX_GRAD_NORM: Final = "max-grad-norm"
CFG_EVAL_BATCHES: Final = "eval-batches"
CFG_STEP_BUDGET: Final = "step-budget"  # steps this client may run this round (set per device)
CFG_CLIENT_THREADS: Final = "client-threads"
CFG_CLIENT_STATE_DIR: Final = "client-state-dir"  # "" keeps client state in Context.state
CFG_CLIENT_MODS: Final = "client-mods"  # comma separated "package.module:mod" (fedge.clients.mods)
CFG_OPTIMIZER: Final = (
    "optimizer"  # "auto" (the strategy's own), "adamw", "sgd" (fedge.clients.trainer)
)

CFG_RUN_DIR: Final = "run-dir"
CFG_TENSORBOARD: Final = (
    "tensorboard"  # round metrics as TensorBoard scalars in <run-dir>/tensorboard
)
CFG_MLFLOW: Final = "mlflow"  # "": off; "local": file store <run-dir>/mlruns; else a tracking URI
CFG_MAX_EPSILON: Final = "max-epsilon"  # 0 disables the privacy-budget stop
CFG_AGGREGATOR: Final = (
    "aggregator"  # plain | median | trimmed-mean | krum | "package.module:factory"
)
CFG_TRIM_BETA: Final = "trimmed-mean-beta"  # fraction cut from each tail by trimmed-mean
CFG_KRUM_MALICIOUS: Final = "krum-malicious"  # Krum's f: attackers it must tolerate
CFG_MAX_CLIENT_WEIGHT: Final = "max-client-weight"  # cap on a client's meta/weight (0: none)
CFG_MAX_UPDATE_NORM: Final = (
    "max-update-norm"  # refuse a client update above this L2 norm (0: none)
)
CFG_NORM_MULTIPLE: Final = "norm-bound-multiple"  # refuse updates above x median norm (0: off)
CFG_WEIGHT_MULTIPLE: Final = "weight-cap-multiple"  # cap weights at x median weight (0: off)
CFG_ROBUST_STRICT: Final = "robust-strict"  # refuse a round whose robust rule is too small
CFG_MAX_REJECTED_ROUNDS: Final = "max-rejected-rounds"  # stop after this many rejected sums
DEFAULT_MAX_REJECTED_ROUNDS: Final = 3  # its default, for fedge's loop and SecAggPlus (0: never)
CFG_PRIVACY_BUDGET: Final = "privacy-budget"  # "" or "package.module:factory" (fedge.server.budget)
