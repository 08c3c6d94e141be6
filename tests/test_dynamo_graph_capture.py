"""The program cut from the graph dynamo hands the backend (``frontend/dynamo_graph.py``) is the one
capture traces from the module; the cut's steps on small models; the graphs it refuses, and why; and
``torch.compile(model, backend="mist", dynamic=True, options=...)`` training from it, in a fresh
process as a user types it, next to the same loop run eagerly."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from mist_compiler.frontend.capture import capture
from mist_compiler.frontend.dynamo_graph import (
    GraphCaptureUnsupported, _layer_edges, _one_layer_per_group, _skip_empty_concatenations, _training_graph,
    capture_graph,
)
from mist_compiler.frontend.regions import classify_inputs
from mist_compiler.ir.printer import format_program
from mist_compiler.models import build_model
from user_loop import gpt2_setup, run_user_loop, write_gpt2_plan

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _graph_of(model: nn.Module, ids: torch.Tensor, labels: torch.Tensor | None, dynamic: bool = True, **kwargs):
    """What the backend got: (gm, example_inputs), and the program cut from it (or why not)."""
    got: dict = {}

    def backend(gm, example_inputs, **_):
        got["graph"] = (gm, example_inputs)
        try:
            got["program"] = capture_graph(gm, example_inputs, model, **kwargs)
        except GraphCaptureUnsupported as why:
            got["why"] = str(why)
        return gm.forward

    torch._dynamo.reset()
    call = {"input_ids": ids} if labels is None else {"input_ids": ids, "labels": labels}
    torch.compile(model, backend=backend, dynamic=dynamic)(**call)
    return got


def _summary(program) -> dict:
    graph = program.model_graph
    return {"blocks": [(b.kind, b.class_id) for b in program.blocks], "params": program.params,
            "regions": [(r.layers, len(r.nodes), sorted(r.params.values()), len(r.glue)) for r in graph.regions],
            "pre": len(graph.pre), "post": len(graph.post), "tensors": sorted(graph.tensors.values()),
            "batch": sorted(graph.batch_inputs.values()), "sizes": sorted(graph.sizes.values()),
            "tp": (graph.tp.supported, graph.tp.reason, graph.tp.granularity), "sp": graph.sp.supported,
            "seq": program.seq_len, "dtype": program.dtype, "max_positions": program.max_positions,
            "tied": graph.tied_parameters()}


def _printed(program) -> str:  # placeholder names differ only in the frame's local (self vs capture's model)
    return re.sub(r"l_(self|model)_", "l_", format_program(program))


def _fused_gpt():
    from tests.user_models import fused_gpt

    torch.manual_seed(0)
    return fused_gpt(), 96


@pytest.mark.parametrize("name", ["fused_gpt", "gpt-tiny", "llama-tiny"])
def test_the_cut_program_is_the_captured_program(name):
    model, vocab = _fused_gpt() if name == "fused_gpt" else (build_model(name), 512)
    ids = torch.randint(0, vocab, (4, 16))
    got = _graph_of(model, ids, torch.randint(0, vocab, (4, 16)), dtype="float32")
    assert "why" not in got, got.get("why")
    expected = capture(model, dtype="float32")
    assert _summary(got["program"]) == _summary(expected)
    assert _printed(got["program"]) == _printed(expected)  # IR, classes, saved tensors, joint graphs' ops


def test_a_hugging_face_model_reached_through_a_wrapper_frame(tmp_path):
    """GPT-2: its forward is wrapped (parameters come from ``L['args'][0]``), dynamo lifts ``math.pi``
    and norm epsilons to inputs and computes ``sqrt(head_dim)`` once for every layer. The layers cut
    from the graph are capture's; the code before them is what the user's call runs (without
    ``use_cache=False``, which capture passes, Hugging Face builds no padding mask)."""
    pytest.importorskip("transformers")
    from tests.hf_configs import write_config

    from mist_compiler.torch_compile.backend import _drop_logging_calls

    model = build_model(write_config("gpt2", str(tmp_path / "gpt2"), dropout=False))
    _drop_logging_calls()  # as loading the backend does, once transformers has added Logger.warning_once
    ids = torch.randint(0, 128, (4, 16))
    got = _graph_of(model, ids, torch.randint(0, 128, (4, 16)), dtype="float32")
    assert "why" not in got, got.get("why")
    cut, expected = _summary(got["program"]), _summary(capture(model, dtype="float32"))
    for key in ("params", "post", "tensors", "batch", "tp", "sp", "seq", "max_positions", "tied"):
        assert cut[key] == expected[key], key
    # a layer's own code is the same; capture's also reads the mask, ours computes sqrt(head_dim) itself
    assert [r[0::2] for r in cut["regions"]] == \
        [r[0::2] for r in expected["regions"]]
    assert [b[0] for b in cut["blocks"]] == [b[0] for b in expected["blocks"]]


class _Layer(nn.Module):
    """``layer(x, x0)``: the embedding read again by every layer (glue besides the hidden state)."""

    def __init__(self, width: int, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.fc = nn.Linear(width, width) if kind == "a" else nn.Linear(width, width, bias=False)

    def forward(self, x: torch.Tensor, x0: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.fc(x)) + 0.5 * x0


class _Stack(nn.Module):
    def __init__(self, kinds: str) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.layers = nn.ModuleList(_Layer(8, kind) for kind in kinds)
        self.head = nn.Linear(8, 16)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x0 = x = self.embed(input_ids)
        for layer in self.layers:
            x = layer(x, x0)
        return F.cross_entropy(self.head(x).flatten(0, 1), labels.flatten())


def _cut_steps(model: _Stack):
    from mist_compiler.frontend.capture import group_layers
    from mist_compiler.ir.capture_state import CaptureState

    got = _graph_of(model, torch.randint(0, 16, (2, 5)), torch.randint(0, 16, (2, 5)))
    graph, root, _ = _training_graph(*got["graph"], model)
    state = group_layers(CaptureState(model, "stack", "flash", model=model))
    return graph, root, state


def test_edges_are_read_off_the_graph_and_the_first_layer_input_from_its_twin():
    graph, root, state = _cut_steps(_Stack("aaa"))
    edges = _layer_edges(graph, "layers", state.layer_groups)
    nodes = {n.name: n for n in graph.graph.nodes}
    embedding = edges.inputs[0]
    assert nodes[embedding].target is F.embedding
    for i in (1, 2):
        assert edges.inputs[i] == edges.outputs[i - 1]
        assert all(nodes[edges.inputs[i]] in nodes[u].all_input_nodes for u in edges.input_users[i])
    # in layer 0 the embedding is both the hidden state and glue (``0.5 * x0``): only the reads at the
    # places where layer 1 reads its hidden state count as the hidden state's
    readers = {u.name for u in nodes[embedding].users}
    assert len(edges.input_users[0]) == len(edges.input_users[1]) == 2  # the linear and the residual add
    assert len(readers - edges.input_users[0]) == 3  # 0.5 * x0 in each layer


def test_one_layer_per_group_runs_the_representatives_back_to_back():
    """Layers a, a, b: groups (0, 1) and (2,); the cut keeps layers 0 and 2 (renumbered 0 and 1),
    layer 2 reading layer 0's output, and computes what the model does with layer 1 left out."""
    model = _Stack("aab")
    graph, root, state = _cut_steps(model)
    assert state.layer_groups == ((0, 1), (2,))
    tensors, batch, sizes = classify_inputs(graph, root[0], tuple(root[1]))
    edges = _layer_edges(graph, "layers", state.layer_groups)
    reduced, kept, named = _one_layer_per_group(graph, edges, "layers", state.layer_groups, tensors)
    assert sorted(kept.inputs) == [0, 1] and kept.inputs[1] == kept.outputs[0]
    assert {path for _, path in named.values()} == {"embed.weight", "layers.0.fc.weight", "layers.0.fc.bias",
                                                   "layers.1.fc.weight", "head.weight", "head.bias"}
    real = {"layers.1.fc.weight": "layers.2.fc.weight"}
    ids, labels = torch.randint(0, 16, (2, 5)), torch.randint(0, 16, (2, 5))
    args = []
    for node in reduced.graph.nodes:
        if node.op != "placeholder":
            continue
        if node.name in named:
            args.append(model.get_parameter(real.get(named[node.name][1], named[node.name][1])))
        elif node.name in batch:
            args.append(ids if batch[node.name] == "input_ids" else labels)
        else:
            source, dim = sizes[node.name]
            args.append(ids.shape[dim])
    shorter = _Stack("ab")
    shorter.load_state_dict({k.replace("layers.2", "layers.1"): v for k, v in model.state_dict().items()
                             if not k.startswith("layers.1.")})
    torch.testing.assert_close(reduced(*args)[0], shorter(ids, labels))


def test_empty_concatenations_are_dropped():
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    x.meta["example_value"] = torch.empty(2, 3)
    empty = graph.call_function(torch.tensor, ([],))
    empty.meta["example_value"] = torch.empty(0)
    cat = graph.call_function(torch.cat, ([empty, x],), {"dim": -2})
    graph.output((cat,))
    _skip_empty_concatenations(graph)
    graph.eliminate_dead_code()
    assert [n.op for n in graph.nodes] == ["placeholder", "output"]


@pytest.mark.parametrize("same_labels", [False, True])
def test_a_static_graph_is_traced_again_with_symbolic_sizes(same_labels):
    """torch.compile's default (static sizes), and labels=input_ids (one graph input): dynamo traces
    the call again, from inside the backend, with symbolic sizes; the program cut is capture's."""
    model, vocab = _fused_gpt()
    ids = torch.randint(0, vocab, (4, 16))
    got = _graph_of(model, ids, ids if same_labels else torch.randint(0, vocab, (4, 16)), dynamic=False,
                    dtype="float32")
    assert "why" not in got, got.get("why")
    expected = capture(model, dtype="float32")
    assert _summary(got["program"]) == _summary(expected)
    assert _printed(got["program"]) == _printed(expected)
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    from mist_compiler.frontend.dynamo_graph import _call_model
    assert _debug_get_cache_entry_list(_call_model.__code__) == []  # the second trace left no compiled code


def test_graphs_a_plan_cannot_be_cut_from_say_why():
    model, vocab = _fused_gpt()
    ids = torch.randint(0, vocab, (4, 16))
    static = _graph_of(model, ids, ids.clone(), dynamic=False, retrace=False)["why"]
    assert "static batch and sequence" in static
    assert "not input_ids and labels as two tensors" in _graph_of(model, ids, ids, retrace=False)["why"]
    assert "not the parameters' float32" in _graph_of(model, ids, ids.clone(), dtype="bfloat16")["why"]


def test_torch_compile_dynamic_trains_from_dynamos_graph(tmp_path):
    """Tuned for the cluster the options name, trained by the user's AdamW: the program is the one cut
    from dynamo's graph (no second trace), and training matches eager within rounding noise."""
    result = run_user_loop({"hardware": "cpu", "global_batch": 4, "seq_len": 16, "dtype": "float32"}, cwd=tmp_path,
                           dynamic=True)
    assert result["route"] == "graph", result
    assert result["worst"] <= max(10 * result["noise"], 1e-6), result


def test_torch_compile_dynamic_runs_a_plan_on_a_hugging_face_model(tmp_path):
    """GPT-2 under a plan whose micro-batch (2) is not the user's batch (4): the symbolic graph runs."""
    pytest.importorskip("transformers")
    result = run_user_loop({"plan": write_gpt2_plan(tmp_path)}, gpt2_setup(tmp_path / "gpt2"), tmp_path, dynamic=True)
    assert result["route"] == "graph", result
    assert result["worst"] <= max(10 * result["noise"], 1e-6), result


def test_torch_compile_dynamic_under_torchrun_shards_the_cut_program(tmp_path):
    """ZeRO-1, tensor parallelism (tp 2) and a pipeline (pp 2, tied head) lowered from the program cut
    from dynamo's graph on each rank follow eager training step by step (``tests/torch_compile_runs``)."""
    from tests.dist_utils import free_port

    env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]),
           "MIST_TEST_DYNAMIC": "1"}
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                             "--master-port", str(free_port()), "-m", "tests.torch_compile_runs", "zero1", "tp2", "pp2"],
                            capture_output=True, text=True, timeout=900, cwd=ROOT, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    out = json.loads(result.stdout.strip().splitlines()[-1])
    for plan, row in out["plans"].items():
        assert row["route"] == "graph", (plan, row)
        assert row["same"], (plan, row)
        assert row["worst"] <= max(10 * out["noise"], 1e-6), (plan, row, out["noise"])
        assert row["eval"] == pytest.approx(out["eager_eval"], rel=1e-5), (plan, row)
