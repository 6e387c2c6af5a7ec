"""Constrained decoding on xgrammar: a constraint compiles once (xgrammar caches compiled grammars by
their source), and each constrained sequence owns a `GrammarMatcher` that masks the tokens the grammar
forbids, accepts the token drawn, forks with the sequence and says when the text is complete.

A constraint that does not compile is refused with a ValueError naming it, never run unconstrained. xgrammar is
imported by the first constraint, not at start-up: importing it takes a quarter of a second.
"""

from __future__ import annotations

import functools
import json
import re
import threading
from typing import TYPE_CHECKING

from transformers import PreTrainedTokenizerBase

from pagedllm.sampling_params import StructuredOutputsParams

if TYPE_CHECKING:
    import xgrammar as xgr

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
        import xgrammar as xgr

        return xgr.GrammarMatcher(self.compile(spec))

    def compile(self, spec: StructuredOutputsParams) -> xgr.CompiledGrammar:
        """The compiled grammar of `spec`; ValueError naming the field when it does not compile."""
        compiler = self._get_compiler()
        kind = spec.kind
        try:
            grammar = _grammar(spec)
            if spec.reasoning is not None:
                grammar = _after_reasoning(grammar, spec.reasoning)
            return compiler.compile_grammar(grammar)
        except (RuntimeError, ValueError, TypeError) as error:
            # xgrammar reports every parse and conversion problem as one of these, with the position.
            raise ValueError(f"structured_outputs.{kind} does not compile: {_first_line(error)}") from error

    def _get_compiler(self) -> xgr.GrammarCompiler:
        # Reading the vocabulary takes a quarter of a second: only engines that see a constraint pay it.
        import xgrammar as xgr

        with self._lock:
            if self._compiler is None:
                info = xgr.TokenizerInfo.from_huggingface(
                    self._tokenizer, vocab_size=self._vocab_size, stop_token_ids=self._stop_token_ids
                )
                self._compiler = xgr.GrammarCompiler(info, max_threads=2, cache_limit_bytes=_CACHE_LIMIT_BYTES)
            return self._compiler


def _grammar(spec: StructuredOutputsParams) -> xgr.Grammar:
    import xgrammar as xgr

    kind = spec.kind
    if kind == "json":
        schema = spec.json if isinstance(spec.json, str) else json.dumps(spec.json, sort_keys=True)
        return xgr.Grammar.from_ebnf(_json_schema_grammar(schema))
    if kind == "json_object":
        # An object, as OpenAI's json_object promises (xgrammar's built-in JSON grammar takes any value).
        return xgr.Grammar.from_ebnf(_json_schema_grammar('{"type": "object"}'))
    if kind == "regex":
        return xgr.Grammar.from_regex(spec.regex)
    if kind == "choice":
        return xgr.Grammar.from_ebnf(_choice_grammar(spec.choice))
    return xgr.Grammar.from_ebnf(spec.grammar)


# A thinking block: free text that neither closes nor opens another block, then `</think>` and the blank lines
# templates put after it (at most three: unbounded, a model can loop on blank space). Its opening tag is required
# ("optional" mode: the text may start with the block), or may be written again ("open" mode: the prompt opened the
# block, as DeepSeek-R1's does).
_THINK_BLOCK = """root ::= {begin} body "</think>" [ \\n]{{0,3}}
body ::= TagDispatch(loop_after_dispatch=false, excludes=("</think>", "<think>"))"""


def _after_reasoning(grammar: xgr.Grammar, reasoning: str) -> xgr.Grammar:
    """`grammar` after a reasoning block: an optional one that opens the text, or one already open."""
    import xgrammar as xgr

    if reasoning == "open":
        return xgr.Grammar.concat(xgr.Grammar.from_ebnf(_THINK_BLOCK.format(begin='"<think>"?')), grammar)
    block = xgr.Grammar.from_ebnf(_THINK_BLOCK.format(begin='"<think>"'))
    return xgr.Grammar.union(xgr.Grammar.concat(block, grammar), grammar)


# xgrammar's rule for the characters of a length-bounded string (minLength/maxLength) lets raw control
# characters through, which JSON forbids: strict parsers such as Python's `json` reject the output. Its
# rule for other strings excludes them; this gives the bounded rule the same class.
_BOUNDED_STRING_CHAR = r"[^\"\\\r\n]"
_JSON_STRING_CHAR = r"[^\"\\\0-\x1f]"


@functools.lru_cache(maxsize=256)
def _json_schema_grammar(schema: str) -> str:
    """The EBNF xgrammar writes for a JSON schema, with control characters kept out of every string."""
    import xgrammar as xgr

    grammar = xgr.Grammar.from_json_schema(schema, any_whitespace=False)
    return str(grammar).replace(_BOUNDED_STRING_CHAR, _JSON_STRING_CHAR)


def _choice_grammar(choices: list[str]) -> str:
    # json.dumps quotes a string the way EBNF string literals are written (escapes included).
    return "root ::= " + " | ".join(json.dumps(choice) for choice in choices)


# xgrammar prefixes its messages with a time and the C++ source line: noise to a client.
_SOURCE_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: (Check failed: \(.*?\) is false: )?")


def _first_line(error: Exception) -> str:
    lines = [line for line in str(error).splitlines() if line.strip()]
    return _SOURCE_PREFIX.sub("", lines[0]) if lines else type(error).__name__
