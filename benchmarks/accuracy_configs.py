"""The configurations ``prediction_accuracy.py`` trains and predicts: plans on 1, 2 and 4 local gloo
ranks (``PlanConfig``), the two custom models they use besides the zoo's and two Hugging Face models
(transformers' GPT-2 and Llama, built from configs), and the lists (one rank, several ranks, mixed
precision, tensor parallelism, schedules, Hugging Face models, the quick subset)."""
from __future__ import annotations

from dataclasses import dataclass, replace

from mist_compiler.ir.plan import Offload, Plan, StagePlan
from mist_compiler.models import TransformerConfig, TransformerLM, zoo_config

CUSTOM_MODELS: dict[str, TransformerConfig] = {
    "gpt-wide": TransformerConfig(hidden=512, ffn=2048, layers=3, heads=8, vocab=8192, max_seq=512, family="gpt"),
    "llama-deep": TransformerConfig(hidden=256, ffn=688, layers=8, heads=4, vocab=8192, max_seq=256, norm="rmsnorm",
                                    activation="swiglu", positions="rotary", family="llama"),
}


def gpt_wide() -> TransformerLM:
    """Factory for ``mist_compiler.capture("benchmarks.accuracy_configs:gpt_wide")``."""
    return TransformerLM(CUSTOM_MODELS["gpt-wide"])


def llama_deep() -> TransformerLM:
    return TransformerLM(CUSTOM_MODELS["llama-deep"])


def hf_gpt2():
    """A 4-layer Hugging Face GPT-2 (transformers' own module: Conv1D projections, tanh GELU, head tied to
    the embedding, residual and embedding dropout 0.1 as it ships), built from a config. No attention
    dropout: the rows run SDPA's flash kernel, which has none on a CPU."""
    from transformers import GPT2Config, GPT2LMHeadModel

    return GPT2LMHeadModel(GPT2Config(vocab_size=8192, n_positions=512, n_embd=256, n_layer=HF_LAYERS["hf-gpt2"],
                                      n_head=4, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0))


def hf_llama():
    """A 4-layer Hugging Face Llama (grouped-query attention: 2 KV heads of 4), built from a config."""
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(vocab_size=8192, hidden_size=256, intermediate_size=688,
                                        num_hidden_layers=HF_LAYERS["hf-llama"], num_attention_heads=4,
                                        num_key_value_heads=2, max_position_embeddings=512))


HF_LAYERS = {"hf-gpt2": 4, "hf-llama": 4}  # models nobody here wrote: transformers' own GPT-2 and Llama
FACTORIES = {"gpt-wide": "benchmarks.accuracy_configs:gpt_wide", "llama-deep": "benchmarks.accuracy_configs:llama_deep",
             "hf-gpt2": "benchmarks.accuracy_configs:hf_gpt2", "hf-llama": "benchmarks.accuracy_configs:hf_llama"}


def model_config(name: str, seq_len: int) -> TransformerConfig:
    if name in CUSTOM_MODELS:
        return replace(CUSTOM_MODELS[name], max_seq=max(seq_len, CUSTOM_MODELS[name].max_seq))
    return zoo_config(name, seq_len)


@dataclass(frozen=True)
class StageSpec:
    """One pipeline stage of a ``PlanConfig`` (all its devices on one node)."""

    layers: int
    dp: int = 1
    tp: int = 1
    zero: int = 0
    ckpt: int = 0
    offload: Offload = Offload()


@dataclass(frozen=True)
class PlanConfig:
    """A plan trained through the backend (``mist_compiler.compile``) on local gloo ranks."""

    model: str
    seq_len: int
    global_batch: int
    grad_accum: int
    stages: tuple[StageSpec, ...]
    attention: str = "flash"  # "math": SDPA's math backend (keeps the s x s probabilities)
    kind: str = "plan"
    dtype: str = "float32"  # fp16/bf16: mixed precision (fp32 master), peak memory only (see `timed`)
    grad_dtype: str = "float32"  # the plan's dtype: ZeRO 0/1 keep low-precision gradients
    compiled: bool = False  # the plan's units run (and are priced) compiled by inductor
    schedule: str = "1f1b"  # the pipeline schedule; with ``virtual`` > 1 ``stages`` are the virtual stages
    virtual: int = 1

    @property
    def timed(self) -> bool:
        """Step times are compared for fp32 plans (the compute rates are calibrated in fp32); fp16/bf16
        plans, slow or fast on a CPU for reasons of its own, are compared on peak memory only."""
        return self.dtype == "float32"

    @property
    def tensor_parallel(self) -> bool:
        return any(stage.tp > 1 for stage in self.stages)

    @property
    def world(self) -> int:
        return sum(stage.dp * stage.tp for stage in self.stages[:len(self.stages) // self.virtual])

    @property
    def pipeline_stages(self) -> int:
        """Groups of devices (each holds ``virtual`` of the stages)."""
        return len(self.stages) // self.virtual

    def plan(self) -> Plan:
        built, start = [], 0
        for stage in self.stages:
            built.append(StagePlan(layers=(start, start + stage.layers), nodes=1, gpus_per_node=stage.dp * stage.tp,
                                   micro_batch=self.global_batch // (stage.dp * self.grad_accum), dp=stage.dp,
                                   tp=stage.tp, zero=stage.zero, ckpt_layers=stage.ckpt, offload=stage.offload))
            start += stage.layers
        plan = Plan(self.model, self.seq_len, self.global_batch, self.dtype, self.grad_accum, tuple(built),
                    self.grad_dtype, compiled=self.compiled, schedule=self.schedule, virtual_stages=self.virtual)
        plan._check_consistency()
        return plan

    @property
    def label(self) -> str:
        def stage_label(stage: StageSpec) -> str:
            parts = [f"dp{stage.dp}" if stage.dp > 1 else "", f"tp{stage.tp}" if stage.tp > 1 else "",
                     f"z{stage.zero}" if stage.zero else "", f"ck{stage.ckpt}" if stage.ckpt else ""]
            offload = stage.offload
            parts += [f"o{name[0]}{value:g}" for name, value in (("weights", offload.weights), ("grads", offload.grads),
                                                                ("opt", offload.opt), ("acts", offload.acts)) if value]
            return ",".join(part for part in parts if part) or "-"

        pipeline = "|".join(stage_label(stage) for stage in self.stages)
        accum = f" ga{self.grad_accum}" if self.grad_accum > 1 else ""
        math = " math" if self.attention == "math" else ""
        precision = {"float32": "", "float16": " fp16", "bfloat16": " bf16"}[self.dtype]
        precision += " lpg" if self.grad_dtype != "float32" else ""
        precision += " compiled" if self.compiled else ""
        schedule = "" if self.schedule == "1f1b" else f" {self.schedule}" + (f"/{self.virtual}" if self.virtual > 1 else "")
        return (f"{self.world}r {self.model} {pipeline} gb{self.global_batch}{accum} s{self.seq_len}{math}{precision}"
                f"{schedule}")


def _stages(*stages: StageSpec) -> tuple[StageSpec, ...]:
    return stages


def one_rank(model: str, batch: int, seq_len: int, ckpt: int = 0, attention: str = "flash") -> PlanConfig:
    """One rank, one stage with the whole model (no communication)."""
    layers = HF_LAYERS[model] if model in HF_LAYERS else model_config(model, seq_len).layers
    return PlanConfig(model, seq_len, batch, 1, _stages(StageSpec(layers, ckpt=ckpt)), attention)


ONE_RANK_CONFIGS: list[PlanConfig] = [
    one_rank("gpt-small", 2, 256),
    one_rank("gpt-small", 4, 256),
    one_rank("gpt-small", 8, 128),
    one_rank("gpt-small", 4, 256, ckpt=2),
    one_rank("gpt-small", 8, 256, ckpt=4),
    one_rank("gpt-small", 1, 64),
    one_rank("llama-small", 2, 256),
    one_rank("llama-small", 4, 256, ckpt=2),
    one_rank("llama-small", 8, 128),
    one_rank("gpt-wide", 2, 512),
    one_rank("gpt-wide", 4, 256, ckpt=3),
    one_rank("llama-deep", 4, 256),
    one_rank("llama-deep", 8, 256, ckpt=4),
    one_rank("llama-deep", 2, 128),
    one_rank("gpt-small", 2, 256, attention="math"),
    one_rank("llama-small", 2, 128, ckpt=2, attention="math"),
]
PLAN_CONFIGS: list[PlanConfig] = [
    # 2 ranks: data parallel at every ZeRO level, checkpointing, each kind of offload, pipelines
    PlanConfig("gpt-small", 256, 8, 1, _stages(StageSpec(4, dp=2))),
    PlanConfig("gpt-small", 256, 8, 2, _stages(StageSpec(4, dp=2, zero=1))),
    PlanConfig("gpt-small", 256, 8, 1, _stages(StageSpec(4, dp=2, zero=2))),
    PlanConfig("gpt-small", 256, 8, 1, _stages(StageSpec(4, dp=2, zero=3, ckpt=2))),
    PlanConfig("gpt-small", 256, 8, 1, _stages(StageSpec(4, dp=2, zero=2, offload=Offload(grads=0.5, opt=0.5)))),
    PlanConfig("gpt-small", 256, 8, 1, _stages(StageSpec(4, dp=2, offload=Offload(weights=0.5, acts=0.5)))),
    PlanConfig("llama-small", 128, 16, 1, _stages(StageSpec(4, dp=2, zero=3, offload=Offload(acts=0.5)))),
    PlanConfig("gpt-small", 256, 8, 4, _stages(StageSpec(2), StageSpec(2))),
    PlanConfig("llama-small", 256, 8, 2, _stages(StageSpec(2, ckpt=1), StageSpec(2))),
    # 4 ranks (two per core on this machine)
    PlanConfig("gpt-small", 256, 8, 1, _stages(StageSpec(4, dp=4, zero=3))),
    PlanConfig("llama-small", 256, 8, 2, _stages(StageSpec(4, dp=4, zero=1, offload=Offload(opt=1.0)))),
    PlanConfig("gpt-small", 256, 8, 2, _stages(StageSpec(2, dp=2, zero=2, ckpt=1),
                                               StageSpec(2, dp=2, zero=2, offload=Offload(grads=0.5)))),
    PlanConfig("llama-small", 256, 8, 2, _stages(StageSpec(2, dp=2, zero=1, ckpt=2), StageSpec(2, dp=2, zero=3))),
]
# mixed precision (fp32 master), peak memory only: bf16/fp16 compute, low-precision gradients (lpg)
PRECISION_CONFIGS: list[PlanConfig] = [
    PlanConfig("gpt-small", 256, 4, 1, _stages(StageSpec(4)), dtype="bfloat16"),
    PlanConfig("gpt-small", 256, 8, 4, _stages(StageSpec(4, ckpt=4)), dtype="bfloat16", grad_dtype="bfloat16"),
    PlanConfig("llama-small", 128, 2, 1, _stages(StageSpec(4, ckpt=2)), "math", dtype="float16"),
    PlanConfig("gpt-small", 256, 8, 2, _stages(StageSpec(4, dp=2, zero=1)), dtype="bfloat16", grad_dtype="bfloat16"),
    PlanConfig("gpt-small", 128, 8, 2, _stages(StageSpec(4, dp=2, ckpt=2)), dtype="float16", grad_dtype="float16"),
    PlanConfig("llama-small", 128, 16, 1, _stages(StageSpec(4, dp=2, zero=3, ckpt=2, offload=Offload(opt=0.5))),
               dtype="bfloat16"),
    PlanConfig("gpt-small", 256, 8, 4, _stages(StageSpec(2), StageSpec(2)), dtype="bfloat16", grad_dtype="bfloat16"),
    PlanConfig("llama-small", 256, 8, 2, _stages(StageSpec(4, dp=4, zero=1)), dtype="bfloat16", grad_dtype="bfloat16"),
    PlanConfig("gpt-small", 256, 8, 2, _stages(StageSpec(2, dp=2, zero=2, ckpt=1), StageSpec(2, dp=2, zero=1)),
               dtype="bfloat16", grad_dtype="bfloat16"),
]
# tensor parallelism: the lowering shards the captured graph the cost model prices (one recogniser),
# the LM head and loss as the fused vocabulary-parallel cross-entropy (tp.linear_cross_entropy)
TP_CONFIGS: list[PlanConfig] = [
    PlanConfig("llama-small", 256, 8, 1, _stages(StageSpec(4, tp=2))),
    PlanConfig("gpt-small", 256, 8, 1, _stages(StageSpec(4, tp=2, ckpt=2))),
    PlanConfig("gpt-small", 256, 8, 2, _stages(StageSpec(4, dp=2, tp=2, zero=1))),
    PlanConfig("gpt-small", 256, 8, 1, _stages(StageSpec(4, tp=2)), dtype="bfloat16"),
]
# pipeline schedules on 4 ranks (two stages of two data-parallel ranks): each beside its 1F1B twin
SCHEDULE_CONFIGS: list[PlanConfig] = [
    PlanConfig("gpt-small", 256, 16, 4, _stages(StageSpec(2, dp=2), StageSpec(2, dp=2))),
    PlanConfig("gpt-small", 256, 16, 4, _stages(StageSpec(2, dp=2), StageSpec(2, dp=2)), schedule="zb-h1"),
    PlanConfig("gpt-small", 256, 16, 4, _stages(*(StageSpec(1, dp=2) for _ in range(4))), schedule="interleaved",
               virtual=2),
    PlanConfig("llama-small", 256, 16, 4, _stages(StageSpec(2, dp=2, zero=1), StageSpec(2, dp=2, zero=1))),
    PlanConfig("llama-small", 256, 16, 4, _stages(*(StageSpec(1, dp=2, zero=1) for _ in range(4))), schedule="zbv",
               virtual=2),
    PlanConfig("llama-small", 256, 16, 4, _stages(StageSpec(2, dp=2, zero=1, ckpt=1), StageSpec(2, dp=2, zero=1)),
               schedule="zb-h1"),
    # the same schedules on 2 ranks (a core each on a 2-core machine: a rank idle in a bubble hands no
    # core to another, as a device would not; with 4 ranks on 2 cores the step is set by the total work)
    PlanConfig("gpt-small", 256, 8, 4, _stages(StageSpec(2), StageSpec(2))),
    PlanConfig("gpt-small", 256, 8, 4, _stages(StageSpec(2), StageSpec(2)), schedule="zb-h1"),
    PlanConfig("gpt-small", 256, 8, 4, _stages(*(StageSpec(1) for _ in range(4))), schedule="interleaved", virtual=2),
    PlanConfig("llama-small", 256, 8, 4, _stages(StageSpec(2), StageSpec(2))),
    PlanConfig("llama-small", 256, 8, 4, _stages(*(StageSpec(1) for _ in range(4))), schedule="zbv", virtual=2),
]
# Hugging Face models (transformers' modules, GPT-2 with its dropout, Llama with grouped-query attention)
HF_CONFIGS: list[PlanConfig] = [
    one_rank("hf-gpt2", 2, 256),
    one_rank("hf-llama", 2, 256),
    one_rank("hf-llama", 4, 256, ckpt=2),
    PlanConfig("hf-gpt2", 256, 8, 1, _stages(StageSpec(4, dp=2, zero=3, ckpt=2))),
    PlanConfig("hf-llama", 256, 8, 2, _stages(StageSpec(4, dp=2, zero=1))),
    PlanConfig("hf-llama", 256, 8, 2, _stages(StageSpec(2, dp=2, zero=2), StageSpec(2, dp=2, zero=2))),
]
CONFIGS: list[PlanConfig] = ONE_RANK_CONFIGS + PLAN_CONFIGS + PRECISION_CONFIGS + TP_CONFIGS + SCHEDULE_CONFIGS + HF_CONFIGS
QUICK: list[PlanConfig] = [ONE_RANK_CONFIGS[0], ONE_RANK_CONFIGS[14], PLAN_CONFIGS[3], PLAN_CONFIGS[7], PLAN_CONFIGS[11],
                           PRECISION_CONFIGS[1], PRECISION_CONFIGS[3]]
