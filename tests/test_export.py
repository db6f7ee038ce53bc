"""``dapo-lightning export CKPT OUT``: a trained policy out of a Lightning checkpoint as a Hugging
Face folder that ``from_pretrained`` and ``vllm.LLM`` load, and the errors for bad input.

The checkpoints are real: a DAPOModule fitted for 2 updates by the Trainer (tests/_module_harness)
and saved with ``trainer.save_checkpoint``, and a 2-update run of the console script.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
from _module_harness import fit_update
from test_cli import QUICKSTART, TINY, check, run_cli, write_override
from transformers import AutoModelForCausalLM, AutoTokenizer

from dapo_lightning.cli import main
from dapo_lightning.export import export_checkpoint, export_pretrained
from dapo_lightning.testing import make_tiny_checkpoint


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A tiny base folder, a module fitted 2 updates from it, and its saved checkpoint."""
    root = tmp_path_factory.mktemp("export")
    base = make_tiny_checkpoint(root / "base", seed=1)
    _, module = fit_update(str(base), micro_batch_size=4, steps=2)
    assert module.policy_version == 2
    ckpt = root / "run.ckpt"
    module.trainer.save_checkpoint(ckpt)
    weights = {k: v.detach().clone() for k, v in module.policy.state_dict().items()}
    return {"root": root, "base": base, "ckpt": ckpt, "weights": weights}


def _assert_same_weights(model, weights):
    state = model.state_dict()
    assert set(state) == set(weights)
    for key, value in weights.items():
        assert torch.equal(state[key], value), key


def test_export_writes_exactly_the_trained_weights_and_a_working_tokenizer(trained, tmp_path):
    out = tmp_path / "exported"
    main(["export", str(trained["ckpt"]), str(out)])  # the console entry's dispatch
    assert (out / "model.safetensors").is_file() and not list(tmp_path.glob(".*tmp*"))
    model = AutoModelForCausalLM.from_pretrained(out)
    _assert_same_weights(model, trained["weights"])
    base = AutoModelForCausalLM.from_pretrained(trained["base"])
    assert not torch.equal(base.model.embed_tokens.weight, model.model.embed_tokens.weight)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()  # tied

    tok = AutoTokenizer.from_pretrained(out)
    text = "Tom has 3 boxes. 3*4-2=10 <|im_end|>"
    assert tok.decode(tok(text, add_special_tokens=False)["input_ids"]) == text
    assert tok.chat_template == AutoTokenizer.from_pretrained(trained["base"]).chat_template
    chat = tok.apply_chat_template(
        [{"role": "user", "content": "2+3="}], tokenize=False, add_generation_prompt=True
    )
    assert chat == "<|im_start|>user\n2+3=<|im_end|>\n<|im_start|>assistant\n"
    gen = json.loads((out / "generation_config.json").read_text())
    assert gen["eos_token_id"] == tok.eos_token_id and gen["pad_token_id"] == tok.pad_token_id


def test_export_pretrained_fills_missing_eos_and_pad(trained, tmp_path):
    model = AutoModelForCausalLM.from_pretrained(trained["base"])
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = None
    tok = AutoTokenizer.from_pretrained(trained["base"])
    out = export_pretrained(model, tok, tmp_path / "m")
    gen = json.loads((out / "generation_config.json").read_text())
    assert (gen["eos_token_id"], gen["pad_token_id"]) == (tok.eos_token_id, tok.pad_token_id)
    with pytest.raises(TypeError, match="transformers model"):
        export_pretrained(torch.nn.Linear(2, 2), tok, tmp_path / "n")


def test_moved_model_folder_names_the_hparam_and_the_override(trained, tmp_path):
    moved = tmp_path / "moved-base"
    shutil.copytree(trained["base"], moved)
    _, module = fit_update(str(moved), micro_batch_size=16, steps=1)
    ckpt = tmp_path / "moved.ckpt"
    module.trainer.save_checkpoint(ckpt)
    shutil.rmtree(moved)
    with pytest.raises(FileNotFoundError, match=r"model_name_or_path=.*moved-base.*--model_name"):
        export_checkpoint(ckpt, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    out = export_checkpoint(ckpt, tmp_path / "out", model_name_or_path=trained["base"])
    _assert_same_weights(AutoModelForCausalLM.from_pretrained(out), module.policy.state_dict())


def test_bad_checkpoints_get_clear_errors(trained, tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        export_checkpoint(tmp_path / "nope.ckpt", tmp_path / "o1")
    truncated = tmp_path / "truncated.ckpt"
    truncated.write_bytes(trained["ckpt"].read_bytes()[:1000])
    with pytest.raises(ValueError, match="could not be read as a Lightning checkpoint"):
        export_checkpoint(truncated, tmp_path / "o2")
    (tmp_path / "sharded.ckpt").mkdir()
    with pytest.raises(IsADirectoryError, match="sharded"):
        export_checkpoint(tmp_path / "sharded.ckpt", tmp_path / "o3")
    checkpoint = torch.load(trained["ckpt"], map_location="cpu", weights_only=True)
    checkpoint["state_dict"] = {
        k: v for k, v in checkpoint["state_dict"].items() if "policy" not in k
    }
    torch.save(checkpoint, tmp_path / "no_policy.ckpt")
    with pytest.raises(ValueError, match="no policy weights"):
        export_checkpoint(tmp_path / "no_policy.ckpt", tmp_path / "o4")
    used = tmp_path / "used"
    used.mkdir()
    (used / "keep.txt").write_text("x")
    with pytest.raises(FileExistsError, match="already exists"):
        export_checkpoint(trained["ckpt"], used)
    assert [p.name for p in used.iterdir()] == ["keep.txt"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_cli_error_exits_2_with_the_message(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["export", str(tmp_path / "nope.ckpt"), str(tmp_path / "out")])
    assert exit_info.value.code == 2
    assert "nope.ckpt does not exist" in capsys.readouterr().err


def test_export_of_a_console_script_run(tmp_path):
    """The whole path a user takes: ``dapo-lightning fit`` (2 updates) writes last.ckpt,
    ``dapo-lightning export`` turns it into a folder with the checkpoint's policy weights."""
    run_dir, model_dir = tmp_path / "run", tmp_path / "model"
    override = write_override(tmp_path / "override.yaml", run_dir, model_dir)
    args = ["--config", QUICKSTART, "--config", str(override), *TINY]
    # the random tiny model never answers right: a length-parity reward gives real gradients
    reward = ["--data.reward", '{"class_path": "_length_reward.EvenLengthReward"}']
    check(run_cli("fit", *args, *reward, "--create_model_if_missing", "tiny"))
    ckpt = run_dir / "checkpoints" / "last.ckpt"
    umask = os.umask(0o027)  # the export's files get the modes this umask gives new files
    try:
        proc = check(run_cli("export", str(ckpt), str(tmp_path / "exported")))
    finally:
        os.umask(umask)
    assert f"wrote {tmp_path / 'exported'}" in proc.stdout
    # no warnings (DeepSpeed's CPU-accelerator line among them), no progress bars
    assert "warn" not in proc.stderr.lower() and "Setting accelerator" not in proc.stderr
    assert "Writing model shards" not in proc.stderr, proc.stderr
    modes = {p.name: p.stat().st_mode & 0o777 for p in (tmp_path / "exported").iterdir()}
    assert modes["model.safetensors"] == 0o640 and set(modes.values()) == {0o640}, modes
    assert (tmp_path / "exported").stat().st_mode & 0o777 == 0o750
    state = torch.load(ckpt, map_location="cpu", weights_only=True)["state_dict"]
    trained = {k.removeprefix("policy."): v for k, v in state.items() if k.startswith("policy.")}
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "exported")
    _assert_same_weights(exported, trained)
    initial = AutoModelForCausalLM.from_pretrained(model_dir).state_dict()
    assert any(not torch.equal(initial[k], v) for k, v in trained.items())


VLLM_SCRIPT = """
import json, sys, vllm
llm = vllm.LLM(model=sys.argv[1], dtype="float32", enforce_eager=True, seed=0)
tok = llm.get_tokenizer()
prompt = tok.apply_chat_template(
    [{"role": "user", "content": "3+4="}], tokenize=False, add_generation_prompt=True
)
params = vllm.SamplingParams(max_tokens=8, temperature=1.0, seed=0, logprobs=0)
(out,) = llm.generate([prompt], params)
c = out.outputs[0]
print("RESULT", json.dumps({"ids": list(out.prompt_token_ids), "tokens": list(c.token_ids),
                            "logprobs": [list(d.values())[0].logprob for d in c.logprobs]}))
"""


@pytest.mark.vllm
def test_vllm_loads_the_export_and_generates(trained, tmp_path):
    """vllm.LLM (in its own process, as in a serving job) loads the exported folder, encodes the
    chat prompt as the HF tokenizer does, and samples with log-probs the exported HF model
    gives the same tokens."""
    pytest.importorskip("vllm")
    out = export_checkpoint(trained["ckpt"], tmp_path / "exported")
    env = dict(
        os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_KVCACHE_SPACE="1",
        TOKENIZERS_PARALLELISM="false",
    )  # fmt: skip
    proc = subprocess.run(
        [sys.executable, "-c", VLLM_SCRIPT, str(out)],
        env=env, capture_output=True, text=True, timeout=280,
    )  # fmt: skip
    lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    result = json.loads(lines[0].removeprefix("RESULT "))
    tok = AutoTokenizer.from_pretrained(out)
    chat = [{"role": "user", "content": "3+4="}]
    prompt = tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert result["ids"] == tok(prompt, add_special_tokens=False)["input_ids"]
    assert 1 <= len(result["tokens"]) <= 8
    model = AutoModelForCausalLM.from_pretrained(out).eval()
    ids = torch.tensor([result["ids"] + result["tokens"]])
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=ids).logits[0, :-1].float(), -1)
    start = len(result["ids"]) - 1
    hf = logp[start:].gather(-1, torch.tensor(result["tokens"])[:, None]).squeeze(-1)
    assert torch.allclose(hf, torch.tensor(result["logprobs"]), atol=1e-3)
