"""LoRA adapters: PEFT folders served per request in mixed batches, against peft's merged model; the batched
shrink/expand against a row-by-row product; the prefix cache keyed by adapter; slots, removal and refusals."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from pagedllm import LLM, LoRARequest, SamplingParams
from pagedllm.kv.events import BlockStored
from pagedllm.models.lora import LoRABatch, LoRAStack, Projection
from tests.conftest import save_tiny_model

# family -> (transformers model_type, options, two adapters' (rank, target modules))
FAMILIES = {
    "llama": ("llama", {}, [(8, ["q_proj", "v_proj", "down_proj"]), (4, ["k_proj", "o_proj", "gate_proj", "up_proj"])]),
    "qwen2": (
        "qwen2",
        {},
        [(16, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]), (2, ["o_proj"])],
    ),
    "phi3": ("phi3", {"pad_token_id": 0}, [(8, ["qkv_proj", "gate_up_proj"]), (4, ["o_proj", "down_proj"])]),
}
GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)


def make_adapter(base: Path, folder: Path, rank: int, targets: list[str], seed: int) -> Path:
    """A random PEFT adapter (B not zero, so it changes the outputs) saved as PEFT saves it."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    config = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=targets, init_lora_weights=False)
    get_peft_model(model, config).save_pretrained(folder)
    return folder


def reference(base: Path, adapter: Path | None, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """float32 greedy tokens of transformers' model, with the adapter merged by peft."""
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    if adapter is not None:
        model = PeftModel.from_pretrained(model, adapter).merge_and_unload()
    outputs = []
    with torch.inference_mode():
        for prompt in prompts:
            tokens = list(prompt)
            for _ in range(max_tokens):
                tokens.append(int(model(torch.tensor([tokens])).logits[0, -1].argmax()))
            outputs.append(tokens[len(prompt) :])
    return outputs


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):
    model_type, options, adapters = FAMILIES[request.param]
    root = tmp_path_factory.mktemp(f"lora_{request.param}")
    base = save_tiny_model(root / "base", model_type, **options)
    folders = [make_adapter(base, root / f"a{i}", r, t, seed=i + 1) for i, (r, t) in enumerate(adapters)]
    return base, folders


def prompts_of(lengths: list[int], seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 300) for _ in range(n)] for n in lengths]


def test_each_adapter_equals_peft_merged_in_one_mixed_batch(family):
    base, (first, second) = family
    # Short prompts (grouped, padded) and a long one (its adapter's group, 166 rows beside the other's 25, is
    # multiplied alone in the prefill step), of both adapters and of the base model, all in the same steps.
    lengths = [5, 9, 12, 7, 3, 150, 12, 6, 4]
    adapters = [None, first, second, second, first, first, None, second, first]
    prompts = prompts_of(lengths)
    requests = {first: LoRARequest("first", 1, str(first)), second: LoRARequest("second", 2, str(second))}
    llm = LLM(str(base), dtype="float32", enable_lora=True, max_loras=2)
    loras = [None if a is None else requests[a] for a in adapters]
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=loras)]
    for adapter in (None, first, second):
        picked = [i for i, a in enumerate(adapters) if a == adapter]
        expected = reference(base, adapter, [prompts[i] for i in picked], GREEDY.max_tokens)
        assert [got[i] for i in picked] == expected, adapter
    # The adapters change the outputs: an engine that ignored them would not pass the comparison above.
    assert got[1] != reference(base, None, [prompts[1]], GREEDY.max_tokens)[0]
    assert llm.stats().kv_blocks_used == 0


# Scheduled sequences' slots (-1: the base model); their query lengths are QUERY_LENS. Slot 1's group would pad
# the others' too much, so it is multiplied alone; the others are grouped: as one run of rows and slots
# (slices, padded), with groups of equal size (no padding), or scattered among base rows (indices, padded).
QUERY_LENS = [3, 2, 60, 3, 3, 3]
LAYOUTS = {
    "runs": [2, 3, 1, -1, -1, -1],
    "equal": [0, -1, 1, 3, -1, 2],
    "scattered": [3, 0, 1, -1, 2, -1],
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])  # their rows are added back differently
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_batched_shrink_and_expand_equal_a_row_by_row_product(layout, dtype):
    torch.manual_seed(0)
    shape = Projection(24, (16, 8, 8))
    stack = LoRAStack(shape, max_loras=4, max_rank=6, dtype=dtype, device=torch.device("cpu"))
    pairs = {}
    for slot in range(4):
        rank = slot + 2
        for part, size in enumerate(shape.part_sizes):
            if (slot, part) == (2, 1):
                continue  # a part this adapter leaves alone
            a, b = torch.randn(24, rank), torch.randn(rank, size)
            stack.write(slot, part, a, b)
            pairs[(slot, part)] = (a, b)
    slot_of_seq = LAYOUTS[layout]
    batch = LoRABatch.build(slot_of_seq, QUERY_LENS)
    assert [group.slot for group in batch.own] == [1] and isinstance(batch.own[0].rows, slice)
    grouped = batch.grouped
    assert isinstance(grouped.take, slice) == isinstance(grouped.slots, slice) == (layout == "runs")
    assert (grouped.place is None) == (layout == "equal")
    x = torch.randn(sum(QUERY_LENS), 24)
    out = torch.randn(len(x), 32)
    expected = out.clone()
    row = 0
    for slot, length in zip(slot_of_seq, QUERY_LENS, strict=True):
        for r in range(row, row + length):
            if slot >= 0:
                parts = [
                    x[r] @ pairs[(slot, p)][0] @ pairs[(slot, p)][1] if (slot, p) in pairs else torch.zeros(size)
                    for p, size in enumerate(shape.part_sizes)
                ]
                expected[r] += torch.cat(parts)
        row += length
    added = out.to(dtype)
    stack.add(added, x.to(dtype), batch)
    # bf16: the inputs, the pairs and every product rounded to 8 bits of mantissa.
    tolerance = {"rtol": 1e-5, "atol": 1e-4} if dtype == torch.float32 else {"rtol": 0.05, "atol": 0.5}
    torch.testing.assert_close(added.float(), expected, **tolerance)


@pytest.fixture(scope="module")
def llama_adapters(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora_llama")
    base = save_tiny_model(root / "base", "llama")
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    return base, [make_adapter(base, root / f"a{i}", 8, targets, seed=10 + i) for i in range(3)]


def test_the_prefix_cache_never_shares_blocks_across_adapters(llama_adapters):
    base, (first, second, _) = llama_adapters
    llm = LLM(str(base), dtype="float32", enable_lora=True, max_loras=2)
    prompt = prompts_of([40])[0]  # two full blocks of 16
    one, two = LoRARequest("one", 1, str(first)), LoRARequest("two", 2, str(second))

    stored: list[BlockStored] = []
    llm.engine.add_kv_event_sink(lambda event: stored.append(event) if isinstance(event, BlockStored) else None)

    def hits_after(lora: LoRARequest | None) -> int:
        before = llm.stats().prefix_cache_hits
        llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=2), use_tqdm=False, lora_request=lora)
        return llm.stats().prefix_cache_hits - before

    assert hits_after(one) == 0
    assert hits_after(one) == 32  # the same adapter again: its two cached blocks (hits count tokens)
    assert hits_after(two) == 0  # another adapter: none of them
    assert hits_after(None) == 0  # the base model: none either
    assert hits_after(None) == 32
    # The KV events say whose blocks were stored (vLLM's lora_id): one, two, the base, each once.
    assert [event.lora_id for event in stored] == [1, 2, None]
    assert stored[0].as_dict()["lora_id"] == 1


def test_more_adapters_than_slots_all_run_and_each_is_right(llama_adapters):
    base, adapters = llama_adapters
    llm = LLM(str(base), dtype="float32", enable_lora=True, max_loras=1, max_cpu_loras=2)
    prompts = prompts_of([6, 8, 5, 7, 9, 4], seed=1)
    requests = [LoRARequest(f"a{i}", i + 1, str(folder)) for i, folder in enumerate(adapters)]
    loras = [requests[i % 3] for i in range(len(prompts))]
    manager = llm.engine.worker.lora
    per_step: list[int] = []  # the adapters of each step the worker runs
    activate = manager.activate
    manager.activate = lambda step_loras: (
        per_step.append(len({r.lora_int_id for r in step_loras})) or activate(step_loras)
    )
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=loras)]
    assert max(per_step) == 1 and len(per_step) >= 3 * GREEDY.max_tokens  # the scheduler ran one at a time
    for i, folder in enumerate(adapters):
        picked = [p for p in range(len(prompts)) if p % 3 == i]
        assert [got[p] for p in picked] == reference(base, folder, [prompts[p] for p in picked], GREEDY.max_tokens)
    assert manager.num_slot_writes >= 3 and len(manager.loaded()) == 2  # one slot, two kept in CPU memory


def test_an_adapter_removed_while_in_use_finishes_its_requests_first(llama_adapters):
    base, (first, _, _) = llama_adapters
    llm = LLM(str(base), dtype="float32", enable_lora=True)
    engine, lora = llm.engine, LoRARequest("first", 1, str(first))
    prompts = prompts_of([5, 7], seed=2)
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, GREEDY, lora)
    engine.step()
    assert llm.remove_lora(1) and llm.list_loras() == set()
    outputs = {}
    while engine.has_unfinished_requests():
        outputs |= {o.request_id: o.outputs[0].token_ids for o in engine.step() if o.finished}
    assert [outputs["0"], outputs["1"]] == reference(base, first, prompts, GREEDY.max_tokens)
    assert engine.worker.lora.known_ids() == set()
    assert not llm.remove_lora(1)


def test_ngram_speculation_under_an_adapter_gives_the_same_tokens(llama_adapters):
    base, (first, _, _) = llama_adapters
    lora = LoRARequest("first", 1, str(first))
    span = [7, 8, 9, 10, 11]
    prompts = [span + [40 + i] + span for i in range(3)]
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    llm = LLM(str(base), dtype="float32", enable_lora=True, speculative_config=spec)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, False, lora)]
    assert got == reference(base, first, prompts, params.max_tokens)
    # Guesses ran as further rows of their sequence, under its adapter (a random tiny model takes few of them).
    assert llm.stats().spec_num_draft_tokens > 0


def rewrite_adapter(source: Path, folder: Path, config_changes: dict, weights=None) -> Path:
    folder.mkdir()
    config = json.loads((source / "adapter_config.json").read_text()) | config_changes
    (folder / "adapter_config.json").write_text(json.dumps(config))
    tensors = load_file(source / "adapter_model.safetensors")
    save_file(tensors if weights is None else weights(tensors), folder / "adapter_model.safetensors")
    return folder


def test_bad_adapters_are_refused_naming_the_problem_and_the_engine_serves_on(llama_adapters, tmp_path):
    base, (first, second, _) = llama_adapters
    llm = LLM(str(base), dtype="float32", enable_lora=True, max_lora_rank=8)
    engine = llm.engine
    wide = rewrite_adapter(first, tmp_path / "wide", {"r": 16})
    head = rewrite_adapter(
        first, tmp_path / "head", {}, lambda t: t | {"base_model.model.lm_head.lora_A.weight": torch.zeros(8, 64)}
    )
    lonely = rewrite_adapter(
        first, tmp_path / "lonely", {}, lambda t: {k: v for k, v in t.items() if "lora_B" not in k}
    )
    dora = rewrite_adapter(first, tmp_path / "dora", {"use_dora": True})
    cases = [
        (LoRARequest("wide", 2, str(wide)), r"rank r=16 is above max_lora_rank \(8\)"),
        (LoRARequest("missing", 3, str(tmp_path / "nowhere")), "has no adapter_config.json"),
        (LoRARequest("head", 4, str(head)), r"'base_model\.model\.lm_head\.lora_A\.weight' is not a LoRA pair"),
        (LoRARequest("lonely", 5, str(lonely)), "lora_A without its pair"),
        (LoRARequest("dora", 6, str(dora)), "use_dora=True is not supported"),
        (LoRARequest("again", 1, str(second)), "lora_int_id 1 is already adapter 'first'"),
    ]
    engine.add_lora(LoRARequest("first", 1, str(first)))
    for request, message in cases:
        with pytest.raises(ValueError, match=message):
            engine.add_request("bad", [5, 6, 7], GREEDY, request)
    with pytest.raises(ValueError, match="enable_lora off"):
        LLM(str(base), dtype="float32").generate([5, 6], GREEDY, False, LoRARequest("first", 1, str(first)))
    # Nothing was queued, and the engine still serves the adapter it has.
    assert not engine.has_unfinished_requests()
    out = llm.generate([[5, 6, 7]], GREEDY, use_tqdm=False, lora_request=LoRARequest("first", 1, str(first)))
    assert out[0].outputs[0].token_ids == reference(base, first, [[5, 6, 7]], GREEDY.max_tokens)[0]
    assert llm.stats().kv_blocks_used == 0


def test_lora_options_are_checked():
    with pytest.raises(ValueError, match=r"max_cpu_loras \(1\) must be at least max_loras \(2\)"):
        LLM(enable_lora=True, max_loras=2, max_cpu_loras=1)
    with pytest.raises(ValueError, match="enable_lora runs on one rank only"):
        LLM(enable_lora=True, tensor_parallel_size=2)
