"""Scenario files and links (engine/scenarios/scenario_file.py) and the Playground's runs of them (ui/lab.py, ui/state.py,
ui/scenario_io.py without a page): validation names the bad field, JSON / YAML / link round trips, the size
limits, the shipped preset files equal the registry, and a file's run is the preset's run."""

from __future__ import annotations

import base64
import dataclasses
import json
import random
import zlib

import pytest

from engine import EMBEDDED_MODEL, SamplingParams
from engine.scenarios import scenario_file as sf
from engine.model_loader import load_shared
from engine.scenarios.presets import SCENARIOS, get_scenario
from engine.scenarios.workloads import Workload, WorkloadRequest
from ui.lab import Lab
from ui.scenario_io import lab_scenario, link_query, link_settings, link_steps, runs_shipped_preset
from ui.state import preset_settings, scenario_settings


@pytest.fixture(scope="module")
def loaded():
    return load_shared(EMBEDDED_MODEL)


@pytest.fixture(scope="module")
def tokenize(loaded):
    tokenizer = loaded[1]
    return lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]


def rich() -> dict:
    """A scenario with every field away from its default: text and token-id prompts, arrivals, priorities."""
    return {
        "version": 1, "name": "rich", "description": "every field", "semantics": "v1", "seed": 7,
        "settings": {"block_size": 8, "num_blocks": 40, "max_model_len": 96, "reservation": 64,
                     "contiguous_policy": "max_tokens", "preemption_mode": "recompute", "swap_space_blocks": None,
                     "enable_prefix_caching": False, "watermark": 0.05, "scheduling_policy": "priority",
                     "max_num_batched_tokens": 32},
        "requests": [
            {"arrival_step": 0, "prompt": "ROMEO. But soft: ", "max_tokens": 6, "temperature": 0.7, "top_p": 0.9,
             "top_k": 20, "seed": 3, "n": 2, "stop_token_ids": [5, 9], "priority": 2},
            {"arrival_step": 2, "prompt_token_ids": [40, 41, 42, 43, 44], "max_tokens": 5, "temperature": 0.0,
             "ignore_eos": True, "length_penalty": 0.5, "priority": -1},
        ],
    }


def with_(data: dict, path: str, value) -> dict:
    """``data`` (deep-copied) with ``path`` ("requests.1.max_tokens") set to ``value``."""
    data = json.loads(json.dumps(data))
    *parents, last = path.split(".")
    node = data
    for p in parents:
        node = node[int(p)] if isinstance(node, list) else node[p]
    node[int(last) if isinstance(node, list) else last] = value
    return data


# ------------------------------------------------------------------------------------------- validation
@pytest.mark.parametrize("path, value, message", [
    ("requests.1.max_tokens", 0, "requests.1.max_tokens: must be >= 1, got 0"),
    ("requests.0.temperature", -0.5, "requests.0.temperature: must be >= 0, got -0.5"),
    ("requests.0.top_p", 0, "requests.0.top_p: must be > 0, got 0"),
    ("requests.1.arrival_step", -1, "requests.1.arrival_step: must be >= 0, got -1"),
    ("requests.0.n", True, "requests.0.n: must be an integer, got True"),
    ("requests.0.seed", "3", "requests.0.seed: must be an integer, got '3'"),
    ("requests.0.ignore_eos", "yes", "requests.0.ignore_eos: must be true or false, got 'yes'"),
    ("requests.0.prompt", "", "requests.0.prompt: must not be empty"),
    ("requests.1.prompt_token_ids", [1, -2], "requests.1.prompt_token_ids.1: must be >= 0, got -2"),
    ("settings.block_size", "16", "settings.block_size: must be an integer, got '16'"),
    ("settings.watermark", 1.0, "settings.watermark: must be < 1, got 1.0"),
    ("settings.contiguous_policy", "best", "settings.contiguous_policy: must be one of 'max', 'max_tokens', "
                                           "'pow2' or 'oracle', got 'best'"),
    ("settings.num_blocks", 70_000, "settings.num_blocks: must be <= 65536, got 70000"),
    ("semantics", "v2", "semantics: must be one of 'paper' or 'v1', got 'v2'"),
    ("version", 2, "version: must be one of 1, got 2"),
    ("settings.pool", 3, "settings.pool: unknown field (allowed: block_size, num_blocks"),
    ("requests.0.best_of", 3, "requests.0.best_of: unknown field (allowed: arrival_step, prompt"),
])
def test_a_bad_field_is_named_with_its_value(path, value, message):
    with pytest.raises(ValueError) as err:
        sf.parse_scenario(with_(rich(), path, value))
    assert message in str(err.value)


@pytest.mark.parametrize("change, message", [
    (lambda d: d["requests"][0].update(prompt_token_ids=[1, 2]), "requests.0: give a prompt (text) or "
                                                                 "prompt_token_ids, not both"),
    (lambda d: d["requests"][1].pop("prompt_token_ids"), "requests.1: give a prompt (text) or prompt_token_ids, "
                                                         "got neither"),
    (lambda d: d["requests"][1].update(prompt_token_ids=list(range(96))),
     "requests.1.prompt_token_ids: must be shorter than settings.max_model_len (96 tokens"),
    (lambda d: d.update(semantics="paper"), "settings.scheduling_policy: must be 'fcfs' with semantics 'paper'"),
    (lambda d: d["settings"].update(preemption_mode="swap"), "settings.preemption_mode: must be 'recompute' with "
                                                             "semantics 'v1'"),
    (lambda d: d["requests"][1].update(beam_width=2), "requests.1.beam_width: must be 1 with semantics 'v1'"),
    (lambda d: (d.update(semantics="paper"), d["settings"].update(scheduling_policy="fcfs"),
                d["requests"][0].update(beam_width=2)), "requests.0.beam_width: use n (2) or beam_width (2), not both"),
    (lambda d: d["settings"].update(num_blocks=40_000, block_size=8),
     "settings.num_blocks: 40,000 blocks of 8 tokens are 320,000 slots, more than the 262,144"),
    (lambda d: d["settings"].update(num_blocks=10), "settings.max_model_len: must be at most the pool's 80 slots "
                                                   "(num_blocks 10 x block_size 8), got 96"),
    (lambda d: d.pop("name"), "name: is required"),
])
def test_checks_across_fields_name_the_field(change, message):
    data = rich()
    change(data)
    with pytest.raises(ValueError) as err:
        sf.parse_scenario(data)
    assert message in str(err.value)


def test_a_text_prompt_too_long_for_max_model_len_is_refused_when_tokenized():
    scenario = sf.parse_scenario(with_(rich(), "requests.0.prompt", "x" * 200))
    with pytest.raises(ValueError, match=r"requests\.0\.prompt: must be shorter than settings\.max_model_len "
                                         r"\(96 tokens.*got 200 tokens"):
        sf.to_workload(scenario, lambda text: list(range(len(text))))


def test_a_file_names_itself_in_its_error(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("name: x\nrequests:\n  - prompt: hi\n    max_tokens: 0\n")
    with pytest.raises(ValueError, match=r"bad\.yaml: requests\.0\.max_tokens: must be >= 1, got 0"):
        sf.load_scenario(path)
    assert sf.main(["--check", str(path)]) == 1
    path.write_text("name: x\nrequests:\n  - prompt: hi\n")
    assert sf.main(["--check", str(path)]) == 0


# ------------------------------------------------------------------------------------------ round trips
@pytest.mark.parametrize("fmt", sf.FORMATS)
def test_round_trip_through_text(fmt):
    scenario = sf.parse_scenario(rich())
    text = sf.dump_scenario(scenario, fmt)
    assert sf.parse_text(text, fmt) == scenario
    assert sf.parse_text(text) == scenario  # the format told from the text


@pytest.mark.parametrize("suffix", [".json", ".yaml", ".yml"])
def test_round_trip_through_a_file(tmp_path, suffix):
    scenario = sf.parse_scenario(rich())
    path = tmp_path / f"rich{suffix}"
    sf.save_scenario(scenario, path)
    assert path.read_text().lstrip().startswith("{") == (suffix == ".json")
    assert sf.load_scenario(path) == scenario


def test_round_trip_through_a_link():
    scenario = sf.parse_scenario(rich())
    code = sf.encode_link(scenario)
    assert set(code) <= set("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_")
    assert sf.decode_link(code) == scenario


def test_workload_round_trip_keeps_prompts_params_arrivals_and_priorities(tokenize):
    scenario = sf.parse_scenario(rich())
    workload = sf.to_workload(scenario, tokenize)
    first, second = workload.requests
    assert (first.arrival_step, first.prompt, first.priority) == (0, "ROMEO. But soft: ", 2)
    assert first.params == SamplingParams(max_tokens=6, temperature=0.7, top_p=0.9, top_k=20, seed=3, n=2,
                                          stop_token_ids=(5, 9))
    assert (second.arrival_step, second.prompt, second.priority) == (2, [40, 41, 42, 43, 44], -1)
    assert sf.from_workload(workload, scenario.settings.model_dump(), "v1", description="every field") == scenario


# ----------------------------------------------------------------------------------------------- limits
def test_a_file_over_the_size_limit_is_refused_before_reading(tmp_path):
    path = tmp_path / "big.json"
    path.write_text(" " * (sf.MAX_FILE_BYTES + 1))
    with pytest.raises(ValueError, match="262,145 bytes, more than 262,144"):
        sf.load_scenario(path)
    with pytest.raises(ValueError, match="more than 262,144"):
        sf.parse_text(b" " * (sf.MAX_FILE_BYTES + 1))


def test_more_requests_than_the_limit_are_refused():
    data = {"name": "many", "requests": [{"prompt": "a"}] * (sf.MAX_REQUESTS + 1)}
    with pytest.raises(ValueError, match="requests: must hold at most 256 items"):
        sf.parse_scenario(data)
    data["requests"].pop()
    assert len(sf.parse_scenario(data).requests) == sf.MAX_REQUESTS


@pytest.mark.parametrize("code, message", [
    ("x" * (sf.MAX_LINK_CHARS + 1), "8,001 characters, more than 8,000"),
    ("abc$def", "characters other than letters"),
    (sf.encode_link(sf.parse_scenario(rich()))[:60], "damaged"),  # cut short
    (base64.urlsafe_b64encode(zlib.compress(b"hello")).decode(), "damaged"),  # not JSON
    (base64.urlsafe_b64encode(zlib.compress(b"[" + b" " * sf.MAX_FILE_BYTES + b"]")).decode().rstrip("="),
     "holds more than 262,144 bytes"),  # a small link that inflates beyond a file's limit
    (base64.urlsafe_b64encode(zlib.compress(b"[1, 2]")).decode().rstrip("="), "must be a mapping of fields"),
    (base64.urlsafe_b64encode(zlib.compress(json.dumps(with_(rich(), "requests.1.max_tokens", 0)).encode()))
     .decode().rstrip("="), "requests.1.max_tokens: must be >= 1, got 0"),
])
def test_a_bad_link_says_what_is_wrong(code, message):
    with pytest.raises(ValueError, match=message):
        sf.decode_link(code)


def test_a_scenario_too_big_for_a_link_is_refused_by_name():
    rng = random.Random(0)  # random ids: they do not compress
    data = {"name": "big", "settings": {"max_model_len": 4096, "num_blocks": 512},
            "requests": [{"prompt_token_ids": [rng.randrange(2048) for _ in range(4000)]} for _ in range(4)]}
    with pytest.raises(ValueError, match=r"link would be [\d,]+ characters, more than 8,000 .*save it as a file"):
        sf.encode_link(sf.parse_scenario(data))


@pytest.mark.parametrize("text, message", [
    ("a: &x [1, 2]\nb: *x\n", "YAML alias"),
    ("name: x\nrequests: [\n", "not valid YAML"),
    ('{"name": "x", ', "not valid JSON"),
    ("[" * 100_000 + "]" * 100_000, r"not a scenario: its lists and mappings are nested more than 16 levels deep"),
    ('{"name": "x", "seed": ' + "9" * 5000 + "}", r"^seed: must be < 4611686018427387904, got an integer of 5,000 "
                                                   r"digits$"),
    (b"\xff\xfe", "not UTF-8"),
])
def test_text_that_is_no_scenario_is_refused(text, message):
    with pytest.raises(ValueError, match=message):
        sf.parse_text(text)


def test_the_block_limit_is_the_engines():
    from engine.llm_engine import MAX_RECORDED_BLOCKS

    assert sf.MAX_NUM_BLOCKS == MAX_RECORDED_BLOCKS


# ------------------------------------------------------------------------------------ shipped presets
@pytest.mark.parametrize("name", list(SCENARIOS))
def test_each_shipped_file_is_what_the_registry_gives(name, tokenize):
    """``python -m engine.scenarios.scenario_file --write-presets`` would write the same bytes: the files cannot drift."""
    path = sf.preset_path(name)
    assert path.is_file(), f"{path} missing: run python -m engine.scenarios.scenario_file --write-presets"
    expected = sf.registry_file(name, tokenize)
    assert sf.load_preset(name) == expected
    assert path.read_text() == sf.dump_scenario(expected, "json")
    workload = get_scenario(name).make(sf.PRESET_SEED, tokenize)
    assert sf.to_workload(expected, tokenize).requests == workload.requests


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_the_playgrounds_preset_run_is_the_files_run(name, loaded, tokenize):
    """The Playground builds a preset from its file: the same settings, the same requests (the registry's at
    the same seed), and the lab's own run as a file is the shipped file again."""
    shipped = sf.load_preset(name)
    settings = preset_settings(name)
    assert {k: getattr(settings, k) for k in sf.ScenarioSettings.model_fields} == shipped.settings.model_dump()
    assert (settings.semantics, settings.seed) == (shipped.semantics, shipped.seed)
    lab = Lab.create(settings, loaded)
    assert [r for r, _ in lab.run.pending] == get_scenario(name).make(sf.PRESET_SEED, tokenize).requests
    assert lab_scenario(lab) == shipped
    assert runs_shipped_preset(lab) and link_query(lab) == {"scenario": name, "step": "0"}
    assert scenario_settings(shipped) == settings  # opening the shipped file is the preset again


def test_a_preset_at_another_seed_or_model_comes_from_the_registry(tokenize):
    assert sf.preset_workload("batch", 5, tokenize) == get_scenario("batch").make(5, tokenize)
    assert sf.preset_workload("batch", 5, tokenize).requests[0].params.seed == 5000
    other = sf.preset_workload("chat-workload", 0, lambda t: [1] * len(t), model="/some/other/model")
    assert other == get_scenario("chat-workload").make(0, lambda t: [1] * len(t))
    with pytest.raises(ValueError, match="unknown scenario '../../etc/passwd'"):
        sf.load_preset("../../etc/passwd")


def test_a_run_with_arrivals_saved_midway_is_the_preset_file(loaded):
    """chat-arrivals' requests arrive over time: after 12 steps the lab's file holds those that arrived (at the
    step they did) and those still to come, and is still the shipped file."""
    lab = Lab.create(preset_settings("chat-arrivals"), loaded)
    for _ in range(12):
        lab.step()
    assert lab.run.arrivals and lab.run.pending
    assert [r.arrival_step for _, r in lab.run.arrivals] == [r.arrival_step for r in
                                                          sf.load_preset("chat-arrivals").requests[:len(lab.run.arrivals)]]
    assert lab_scenario(lab) == sf.load_preset("chat-arrivals")
    assert link_query(lab) == {"scenario": "chat-arrivals", "step": "12"}


# ------------------------------------------------------------------------------------- runs of files
def test_a_custom_run_saved_and_opened_is_the_same_run(loaded):
    """Requests added by hand mid-run (one sampling without a seed, one with a priority in V1) saved as a file,
    opened in a fresh lab and run as many steps: the same requests at the same steps, the same snapshots."""
    settings = dataclasses.replace(preset_settings("batch"), semantics="v1", scheduling_policy="priority",
                                   max_num_batched_tokens=64)
    lab = Lab.create(settings, loaded)
    for _ in range(3):
        lab.step()
    lab.add_request("HAMLET. Who is there?", SamplingParams(max_tokens=6, temperature=0.9), priority=-1)
    for _ in range(4):
        lab.step()
    lab.add_request([40, 41, 42], SamplingParams(max_tokens=4, temperature=0.0))
    lab.step()
    assert not runs_shipped_preset(lab)
    scenario = lab_scenario(lab)
    added = scenario.requests[-2:]
    assert [(r.arrival_step, r.priority) for r in added] == [(3, -1), (7, 0)]
    assert added[0].seed == lab.run.paged.requests["R7"].seed  # the seed the engine drew, so the same tokens

    query = link_query(lab)
    assert query["step"] == "8"
    again = Lab.create(link_settings(query["scenario"]), loaded)
    assert again.run.settings.preset == "custom" and again.run.settings.scenario == scenario
    for _ in range(link_steps(query["step"])):
        again.step()
    assert again.run.paged.requests["R7"].priority == -1
    assert lab_scenario(again) == scenario
    for (p1, c1), (p2, c2) in zip(lab.run.history, again.run.history, strict=True):
        assert p1.snapshot == p2.snapshot and c1.snapshot == c2.snapshot
        assert p1.new_tokens == p2.new_tokens


def test_a_file_with_a_pool_sized_by_budget_saves_the_blocks_it_got(loaded):
    lab = Lab.create(dataclasses.replace(preset_settings("single"), kv_budget_mb=0.5), loaded)
    assert lab_scenario(lab).settings.num_blocks == lab.run.paged.num_blocks != 64


def test_link_steps_are_checked():
    assert link_steps(None) == 0 and link_steps("17") == 17
    with pytest.raises(ValueError, match="step -3 is out of range: a link's step counts from 0"):
        link_steps("-3")
    with pytest.raises(ValueError, match="2,001 is more than the 2,000 steps a link may run"):
        link_steps("2001")


def test_a_workload_file_keeps_text_and_token_prompts(tokenize):
    workload = Workload("w", 3, [WorkloadRequest(0, "ROMEO. ", SamplingParams(max_tokens=4)),
                                 WorkloadRequest(5, [1, 2, 3], SamplingParams(max_tokens=2, ignore_eos=True))])
    scenario = sf.from_workload(workload, {"max_model_len": 64, "num_blocks": 8})
    assert [r.prompt for r in scenario.requests] == ["ROMEO. ", None]
    assert scenario.requests[1].prompt_token_ids == [1, 2, 3] and scenario.settings.num_blocks == 8
    assert sf.to_workload(scenario, tokenize) == workload


def test_the_playground_reads_its_presets_from_the_files(tmp_path, monkeypatch, loaded):
    """Edit a shipped file (here a copy): the Playground's preset follows the file, not the registry."""
    edited = sf.load_preset("batch").model_dump()
    edited["settings"]["num_blocks"] = 20
    edited["requests"][0]["max_tokens"] = 3
    monkeypatch.setattr(sf, "PRESETS_DIR", tmp_path)
    sf.save_scenario(sf.parse_scenario(edited), tmp_path / "batch.json")
    settings = preset_settings("batch")
    assert settings.num_blocks == 20
    lab = Lab.create(settings, loaded)
    assert lab.run.pending[0][0].params.max_tokens == 3 and lab.run.paged.num_blocks == 20
    assert lab_scenario(lab) == sf.parse_scenario(edited)


def test_a_files_requests_learn_their_final_lengths_under_oracle(loaded):
    """Like a preset's: the contiguous "oracle" policy reserves each file request's true final length, learned
    from a headless paged run of the same requests first."""
    data = sf.load_preset("batch").model_dump()
    data["name"], data["settings"]["contiguous_policy"] = "batch-oracle", "oracle"
    settings = scenario_settings(sf.parse_scenario(data))
    assert settings.preset == "custom"
    lab = Lab.create(settings, loaded)
    assert len(lab.run.pending) == 6 and all(final is not None for _, final in lab.run.pending)


# ------------------------------------------------------------------------------------ max_tokens over max_model_len
LONG_ASK = {"name": "long-ask", "settings": {"max_model_len": 64, "num_blocks": 8, "block_size": 16},
            "requests": [{"prompt_token_ids": list(range(40, 50)), "max_tokens": 500, "ignore_eos": True},
                         {"prompt": "ROMEO. ", "max_tokens": 20, "ignore_eos": True},
                         {"prompt": "ROMEO. ", "max_tokens": 60, "ignore_eos": True, "arrival_step": 30}]}


def test_max_tokens_past_max_model_len_is_said_naming_both_values(tokenize):
    """vLLM caps such a request (its server clamps max_tokens to max_model_len minus the prompt, its V1
    scheduler finishes it as length-capped; see ``length_notes``) and this engine follows it: the cap was
    silent. Each such request gets a note naming max_tokens, max_model_len, its prompt and where it stops."""
    scenario = sf.parse_scenario(LONG_ASK)
    prompt = len(tokenize("ROMEO. "))
    assert sf.length_notes(scenario, tokenize) == [
        "requests.0: max_tokens 500 is more than max_model_len 64 leaves after its 10-token prompt: it stops at "
        "54 tokens, as vLLM caps it (finish reason \"length\")",
        f"requests.2: max_tokens 60 is more than max_model_len 64 leaves after its {prompt}-token prompt: it stops "
        f"at {64 - prompt} tokens, as vLLM caps it (finish reason \"length\")"]


def test_the_playground_shows_the_cap_and_the_run_stops_where_it_says(loaded, tokenize):
    from ui.lab import Lab
    from ui.state import scenario_settings

    lab = Lab.create(scenario_settings(sf.parse_scenario(LONG_ASK), EMBEDDED_MODEL), loaded)
    notes = [n for n in lab.run.notes if "as vLLM caps it" in n]
    assert len(notes) == 2 and notes[0].startswith("requests.0: max_tokens 500 is more than max_model_len 64")
    while lab.has_work() and lab.steps_run < 300:
        lab.step()
    first = lab.run.paged.requests[lab.run.order[0]]
    assert len(first.seqs[0].output_token_ids) == 54  # where the note said it stops
