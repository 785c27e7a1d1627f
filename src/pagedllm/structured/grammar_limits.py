"""What a grammar may ask of the compiler, counted before it is compiled: a chain of rules
(Lark, GBNF) or of `$ref`s (JSON schema) compiles by recursion inside the grammar library,
and a long enough chain overflows the stack and kills the process (a Lark chain of ~2,800
rules, a `$defs` chain of ~2,500); a counted repetition nested in another (`(a{1000}){1000}`)
asks the lexer for a million states. These limits are far above what real schemas and
grammars use and far below what breaks, and every grammar source (response_format,
guided_*, tools' parameters, Ollama's format) is held to them. Plain Python, no recursion
of its own: a deep input cannot overflow this check either."""
from __future__ import annotations

import json
import re

from pagedllm.structured.spec import GrammarError, GrammarSpec

MAX_RULE_CHAIN = 200  # rules (or $ref targets) followed one from another
MAX_RULES = 5_000  # rules of a grammar, or objects and arrays of a schema
MAX_SCHEMA_DEPTH = 64  # a schema's own nesting of objects and arrays
MAX_REPETITION = 10_000  # a regex's counted repetitions multiplied through their nesting

_LARK_RULE = re.compile(r"^\s*[?!]?([A-Za-z_][A-Za-z0-9_]*)(?:\.-?\d+)?\s*:(?!:)", re.M)
_GBNF_RULE = re.compile(r"^\s*([A-Za-z_][A-Za-z0-9_-]*)\s*::=", re.M)
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_-]*")
# String literals and regexes inside a rule's body: never rule references.
_LITERALS = re.compile(r'"(?:[^"\\]|\\.)*"|/(?:[^/\\\n]|\\.)+/[imslux]*|\[(?:[^\]\\]|\\.)*\]')


def check_limits(spec: GrammarSpec) -> None:
    """Raises GrammarError naming the field when the grammar is past a limit."""
    if spec.kind == "json_schema":
        _check_schema(spec)
    elif spec.kind == "regex":
        _check_regex(spec.source, spec.param)
    else:
        _check_rules(spec, _GBNF_RULE if spec.kind == "gbnf" else _LARK_RULE)


def _check_rules(spec: GrammarSpec, rule_pattern: re.Pattern) -> None:
    starts = list(rule_pattern.finditer(spec.source))
    if len(starts) > MAX_RULES:
        raise GrammarError(spec.param, f"the grammar has {len(starts)} rules; at most "
                                       f"{MAX_RULES} are accepted")
    bodies: dict[str, set[str]] = {}
    for match, following in zip(starts, starts[1:] + [None]):
        body = spec.source[match.end():following.start() if following else len(spec.source)]
        names = set(_NAME.findall(_LITERALS.sub(" ", body)))
        bodies.setdefault(match.group(1), set()).update(names)
    _check_chain({name: refs & bodies.keys() for name, refs in bodies.items()}, spec.param,
                 "rules that use one another")


def _check_schema(spec: GrammarSpec) -> None:
    schema = json.loads(spec.source)
    nodes, definitions = 0, {}
    stack = [(schema, 1, None)]  # (value, depth, the definition it lies in)
    while stack:
        value, depth, owner = stack.pop()
        if not isinstance(value, (dict, list)):
            continue
        nodes += 1
        if nodes > MAX_RULES:
            raise GrammarError(spec.param, f"the schema has more than {MAX_RULES} objects and "
                                           f"arrays")
        if depth > MAX_SCHEMA_DEPTH:
            raise GrammarError(spec.param, f"the schema nests deeper than {MAX_SCHEMA_DEPTH} "
                                           f"levels")
        children = value.items() if isinstance(value, dict) else enumerate(value)
        for key, child in children:
            if isinstance(value, dict) and key == "$ref" and isinstance(child, str):
                definitions.setdefault(owner, set()).add(child)
            if depth == 1 and key in ("$defs", "definitions") and isinstance(child, dict):
                for name, definition in child.items():
                    stack.append((definition, depth + 2, f"#/{key}/{name}"))
                continue
            stack.append((child, depth + 1, owner))
    _check_chain(definitions, spec.param, "$refs that lead one to another")


def _check_chain(graph: dict, param: str, what: str) -> None:
    """The longest path through `graph` (name -> names it uses; a name that comes back to one
    on the path is recursion, which the parser handles, not a chain), without recursing."""
    longest: dict = {}
    for root in graph:
        if root in longest:
            continue
        on_path, stack = {root}, [(root, iter(graph.get(root, ())))]
        while stack:
            node, children = stack[-1]
            child = next(children, None)
            if child is None:
                stack.pop()
                on_path.discard(node)
                longest[node] = 1 + max((longest.get(c, 0) for c in graph.get(node, ())
                                         if c not in on_path), default=0)
                if longest[node] > MAX_RULE_CHAIN:
                    raise GrammarError(param, f"a chain of more than {MAX_RULE_CHAIN} {what}; "
                                              f"flatten it")
            elif child not in longest and child not in on_path and child in graph:
                on_path.add(child)
                stack.append((child, iter(graph.get(child, ()))))


_COUNT = re.compile(r"\{(\d+)(?:,(\d*))?\}")


def _check_regex(pattern: str, param: str) -> None:
    """Counted repetitions multiplied through the groups they nest in: (a{1000}){1000} asks
    for a million copies of `a`."""
    stack = [1]  # per open group: the largest repetition inside it so far
    last_atom, i = 1, 0
    while i < len(pattern):
        char = pattern[i]
        if char == "\\":
            last_atom, i = 1, i + 2
            continue
        if char == "[":  # a class is one atom, whatever brackets it holds
            close = pattern.find("]", i + 2)
            last_atom, i = 1, (len(pattern) if close < 0 else close + 1)
            continue
        if char == "(":
            stack.append(1)
        elif char == ")" and len(stack) > 1:
            last_atom = stack.pop()
            stack[-1] = max(stack[-1], last_atom)
        elif char == "{" and (count := _COUNT.match(pattern, i)):
            times = int(count.group(2) or count.group(1))
            total = last_atom * max(times, 1)
            if total > MAX_REPETITION:
                raise GrammarError(param, f"counted repetitions multiply to {total:,}; at most "
                                          f"{MAX_REPETITION:,} are accepted")
            stack[-1] = max(stack[-1], total)
            i = count.end()
            continue
        else:
            last_atom = 1
        i += 1
