"""Reading PEFT adapters: what peft saves is read exactly; what we cannot serve is refused by name."""

from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors.torch import load_file, save_file

from loraserve.errors import AdapterError
from loraserve.lora.adapter import WEIGHTS_FILE, read_adapter

pytestmark = pytest.mark.slow

ALL_PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.fixture(scope="module")
def spec(loaded_model):
    return loaded_model.model.spec


@pytest.fixture(scope="module")
def save_peft_adapter(model_dir, tmp_path_factory):
    """Save a real peft adapter of the base model (random B so the delta is non-zero).

    Returns its directory and layer 0's q_proj (A, B) as peft holds them.
    """
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    def save(**config):
        path = tmp_path_factory.mktemp("adapter")
        torch.manual_seed(0)
        base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        peft_model = get_peft_model(base, LoraConfig(init_lora_weights=False, **config))
        peft_model.save_pretrained(path)
        q_proj = peft_model.base_model.model.model.layers[0].self_attn.q_proj
        lora_a = getattr(q_proj, "lora_A", None)
        pair = (lora_a["default"].weight.detach(), q_proj.lora_B["default"].weight.detach()) if lora_a else None
        return path, pair

    return save


def test_reads_ranks_scales_and_weights_as_peft_saved_them(save_peft_adapter, spec):
    path, (peft_a, peft_b) = save_peft_adapter(
        r=8,
        lora_alpha=16,
        target_modules=["q_proj", "v_proj", "down_proj"],
        rank_pattern={"v_proj": 4},
        alpha_pattern={"down_proj": 32},
    )
    adapter = read_adapter(path, spec, max_rank=64)
    assert adapter.target_modules == ("q_proj", "v_proj", "down_proj")
    assert len(adapter.weights) == 3 * spec.num_layers
    q, v, down = adapter.weights[(0, "q_proj")], adapter.weights[(0, "v_proj")], adapter.weights[(0, "down_proj")]
    assert (q.rank, v.rank, down.rank) == (8, 4, 8)
    assert (q.scale, v.scale, down.scale) == (16 / 8, 16 / 4, 32 / 8)
    assert torch.equal(q.a, peft_a) and torch.equal(q.b, peft_b)
    assert len(adapter.sha256) == 64 and adapter.num_bytes == (path / WEIGHTS_FILE).stat().st_size


def test_rslora_scales_by_the_square_root_and_a_regex_selects_modules(save_peft_adapter, spec):
    path, _ = save_peft_adapter(r=16, lora_alpha=8, use_rslora=True, target_modules=r".*\.(gate_proj|up_proj)")
    adapter = read_adapter(path, spec, max_rank=64)
    assert adapter.target_modules == ("gate_proj", "up_proj")
    assert adapter.weights[(3, "up_proj")].scale == pytest.approx(8 / math.sqrt(16))


def test_dora_reads_each_modules_magnitude_and_the_engine_works_out_peft_s_scale(save_peft_adapter, spec, llm):
    path, (peft_a, _) = save_peft_adapter(
        r=8, lora_alpha=16, use_dora=True, use_rslora=True, target_modules=["q_proj", "down_proj"],
        rank_pattern={"down_proj": 4},
    )  # fmt: skip
    adapter = read_adapter(path, spec, max_rank=64)
    assert adapter.use_dora and adapter.weights[(0, "down_proj")].rank == 4
    q = adapter.weights[(0, "q_proj")]
    assert q.magnitude is not None and q.magnitude.shape == (spec.num_heads * spec.head_dim,)
    assert torch.equal(q.a, peft_a) and q.dora_scale is None  # the scale needs the base weights
    # The engine's copy has m / ||W + s B A||_row, which PEFT computes from the full matrix.
    scaled = llm.engine.read_adapter(path).weights[(0, "q_proj")]
    weight = llm.engine.loaded.model.projection(0, "q_proj")[0].weight[: q.b.shape[0]].float()
    expected = q.magnitude / torch.linalg.norm(weight + q.scale * q.b @ q.a, dim=1)
    assert scaled.dora_scale is not None and torch.allclose(scaled.dora_scale, expected, rtol=1e-5)


def test_dora_tensors_must_match_the_config(save_peft_adapter, spec, tmp_path):
    path, _ = save_peft_adapter(r=4, lora_alpha=8, use_dora=True, target_modules=["v_proj"])
    with pytest.raises(AdapterError) as error:
        read_adapter(_broken_copy(path, tmp_path / "off", use_dora=False), spec, max_rank=64)
    assert error.value.field == "use_dora"  # magnitudes the config does not ask for are not ignored
    tensors = load_file(path / WEIGHTS_FILE)
    name = next(n for n in tensors if n.endswith("layers.2.self_attn.v_proj.lora_magnitude_vector"))
    for change, message in (("nan", "NaN"), ("short", "does not fit"), ("drop", "missing")):
        broken = _broken_copy(path, tmp_path / change)
        edited = dict(tensors)
        if change == "drop":
            del edited[name]
        else:
            edited[name] = torch.full((7,), 1.0) if change == "short" else edited[name].clone().fill_(math.nan)
        save_file(edited, broken / WEIGHTS_FILE)
        with pytest.raises(AdapterError, match=message) as error:
            read_adapter(broken, spec, max_rank=64)
        assert error.value.field == WEIGHTS_FILE and "layer 2 v_proj" in str(error.value)


def _broken_copy(source, tmp_path, **config_changes):
    tmp_path.mkdir(exist_ok=True)
    for file in source.iterdir():
        (tmp_path / file.name).write_bytes(file.read_bytes())
    config = json.loads((tmp_path / "adapter_config.json").read_text())
    config.update(config_changes)
    (tmp_path / "adapter_config.json").write_text(json.dumps(config))
    return tmp_path


@pytest.fixture(scope="module")
def good_adapter(save_peft_adapter):
    path, _ = save_peft_adapter(r=4, lora_alpha=8, target_modules=ALL_PROJECTIONS)
    return path


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"use_dora": True}, WEIGHTS_FILE),  # DoRA without the magnitude vectors it needs
        ({"use_dora": "yes"}, "use_dora"),
        ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
        ({"bias": "all"}, "bias"),
        ({"lora_bias": True}, "lora_bias"),
        ({"target_modules": ["q_proj", "embed_tokens"]}, "target_modules"),
        ({"target_modules": ["lm_head"]}, "target_modules"),
        ({"target_modules": ".*lm_head"}, "target_modules"),
        ({"peft_type": "IA3"}, "peft_type"),
        ({"r": 0}, "r"),
        ({"lora_alpha": "x"}, "lora_alpha"),
    ],
)
def test_unsupported_config_is_refused_naming_the_field(good_adapter, tmp_path, spec, change, field):
    with pytest.raises(AdapterError) as error:
        read_adapter(_broken_copy(good_adapter, tmp_path, **change), spec, max_rank=64)
    assert error.value.field == field


def test_rank_above_the_maximum_is_refused(good_adapter, spec):
    with pytest.raises(AdapterError, match="above the configured maximum 2") as error:
        read_adapter(good_adapter, spec, max_rank=2)
    assert error.value.field == "r"


def test_pickle_weights_are_refused_and_never_unpickled(good_adapter, tmp_path, spec):
    path = _broken_copy(good_adapter, tmp_path)
    (path / WEIGHTS_FILE).unlink()
    # A pickle that would run code if loaded: it must not be touched.
    (path / "adapter_model.bin").write_bytes(b"cos\nsystem\n(S'touch /tmp/loraserve-pwned'\ntR.")
    with pytest.raises(AdapterError, match="pickle file and is never loaded") as error:
        read_adapter(path, spec, max_rank=64)
    assert error.value.field == WEIGHTS_FILE


def test_missing_and_truncated_files_are_refused(good_adapter, tmp_path, spec):
    path = _broken_copy(good_adapter, tmp_path)
    data = (path / WEIGHTS_FILE).read_bytes()
    (path / WEIGHTS_FILE).write_bytes(data[: len(data) // 2])
    with pytest.raises(AdapterError, match="truncated") as error:
        read_adapter(path, spec, max_rank=64)
    assert error.value.field == WEIGHTS_FILE
    (path / "adapter_config.json").unlink()
    with pytest.raises(AdapterError) as error:
        read_adapter(path, spec, max_rank=64)
    assert error.value.field == "adapter_config.json"


def test_weights_of_another_model_shape_are_refused(good_adapter, tmp_path, spec):
    path = _broken_copy(good_adapter, tmp_path)
    name = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    tensors = {name: torch.zeros(4, 1024), name.replace("lora_A", "lora_B"): torch.zeros(576, 4)}
    save_file(tensors, path / WEIGHTS_FILE)
    with pytest.raises(AdapterError, match="do not fit the base model") as error:
        read_adapter(path, spec, max_rank=64)
    assert error.value.field == WEIGHTS_FILE
