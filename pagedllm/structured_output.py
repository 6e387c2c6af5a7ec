"""Constrained decoding on xgrammar: a constraint compiles once (xgrammar caches compiled grammars by
their source), and each constrained sequence owns a `GrammarMatcher` that masks the tokens the grammar
forbids, accepts the token drawn, forks with the sequence and says when the text is complete.

A constraint that does not compile is refused with a ValueError naming it, never run unconstrained.
"""

from __future__ import annotations

import json
import re
import threading

import xgrammar as xgr
from transformers import PreTrainedTokenizerBase

from pagedllm.sampling_params import StructuredOutputsParams

# Compiled grammars kept for reuse. A JSON schema's grammar is a few hundred KB; this holds thousands.
_CACHE_LIMIT_BYTES = 512 << 20


class StructuredOutputCompiler:
    """Turns `StructuredOutputsParams` into matchers for one tokenizer. Thread-safe: the server compiles
    new constraints on a thread of its own while the engine thread steps, and the engine then finds them
    in the cache."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, vocab_size: int, stop_token_ids: frozenset[int]) -> None:
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._stop_token_ids = sorted(stop_token_ids)
        self._compiler: xgr.GrammarCompiler | None = None
        self._lock = threading.Lock()

    def matcher(self, spec: StructuredOutputsParams) -> xgr.GrammarMatcher:
        return xgr.GrammarMatcher(self.compile(spec))

    def compile(self, spec: StructuredOutputsParams) -> xgr.CompiledGrammar:
        """The compiled grammar of `spec`; ValueError naming the field when it does not compile."""
        compiler = self._get_compiler()
        kind = spec.kind
        try:
            if kind == "json":
                return compiler.compile_json_schema(_bounded_strings_as_patterns(spec.json), any_whitespace=False)
            if kind == "json_object":
                return compiler.compile_builtin_json_grammar()
            if kind == "regex":
                return compiler.compile_regex(spec.regex)
            if kind == "choice":
                return compiler.compile_grammar(_choice_grammar(spec.choice))
            return compiler.compile_grammar(spec.grammar)
        except (RuntimeError, ValueError, TypeError) as error:
            # xgrammar reports every parse and conversion problem as one of these, with the position.
            raise ValueError(f"structured_outputs.{kind} does not compile: {_first_line(error)}") from error

    def _get_compiler(self) -> xgr.GrammarCompiler:
        # Reading the vocabulary takes a quarter of a second: only engines that see a constraint pay it.
        with self._lock:
            if self._compiler is None:
                info = xgr.TokenizerInfo.from_huggingface(
                    self._tokenizer, vocab_size=self._vocab_size, stop_token_ids=self._stop_token_ids
                )
                self._compiler = xgr.GrammarCompiler(info, max_threads=2, cache_limit_bytes=_CACHE_LIMIT_BYTES)
            return self._compiler


def _bounded_strings_as_patterns(schema: str | dict) -> str:
    """The schema's JSON text, with each length-bounded string rewritten as the equivalent pattern.

    xgrammar's rule for a string with minLength/maxLength lets raw control characters through, which JSON
    forbids (strict parsers such as Python's `json` reject the output); its rule for a pattern does not.
    The pattern's class is the characters xgrammar's length rule allows, minus the control characters.
    """
    try:
        tree = json.loads(schema) if isinstance(schema, str) else schema
    except json.JSONDecodeError:
        return schema  # xgrammar reports the syntax error, with its position
    return json.dumps(_rewrite_strings(tree))


def _rewrite_strings(node: object) -> object:
    if isinstance(node, list):
        return [_rewrite_strings(item) for item in node]
    if not isinstance(node, dict):
        return node
    node = {key: _rewrite_strings(value) for key, value in node.items()}
    bounded = "minLength" in node or "maxLength" in node
    if node.get("type") == "string" and bounded and not {"pattern", "format", "enum", "const"} & node.keys():
        low, high = node.pop("minLength", 0), node.pop("maxLength", "")
        node["pattern"] = f'^[^\\x00-\\x1f"\\\\]{{{low},{high}}}$'
    return node


def _choice_grammar(choices: list[str]) -> str:
    # json.dumps quotes a string the way EBNF string literals are written (escapes included).
    return "root ::= " + " | ".join(json.dumps(choice) for choice in choices)


# xgrammar prefixes its messages with a time and the C++ source line: noise to a client.
_SOURCE_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: (Check failed: \(.*?\) is false: )?")


def _first_line(error: Exception) -> str:
    lines = [line for line in str(error).splitlines() if line.strip()]
    return _SOURCE_PREFIX.sub("", lines[0]) if lines else type(error).__name__
