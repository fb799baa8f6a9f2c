"""Whether a JSON schema admits a finite value. llguidance compiles `{"$ref": "#"}`, a `$ref` cycle or an object
that requires itself into a grammar no finite string completes: a constrained answer could then only stop
anywhere, as invalid JSON. The check is the productive-symbols fixpoint of a context-free grammar (Hopcroft &
Ullman, "useless symbols"), over the schema's `$ref` targets: a target is finite once some value of it needs only
targets already known finite.

It looks at recursion only, and says "finite" whenever unsure (a pattern property, `not`, `if`): every other
contradiction is llguidance's to find."""

from __future__ import annotations

from urllib.parse import unquote

UNKNOWN = object()  # a $ref this check cannot follow (another document, an anchor): taken as finite


def resolve(root, ref: str):
    """The sub-schema a local JSON-pointer `$ref` ("#", "#/$defs/a") names in `root`; UNKNOWN otherwise."""
    if not ref.startswith("#") or (len(ref) > 1 and ref[1] != "/"):
        return UNKNOWN
    node = root
    for part in ref[2:].split("/") if len(ref) > 1 else ():
        part = unquote(part).replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return UNKNOWN
    return node


def _refs(node, out: set[str]) -> set[str]:
    if isinstance(node, dict):
        if isinstance(node.get("$ref"), str):
            out.add(node["$ref"])
        for v in node.values():
            _refs(v, out)
    elif isinstance(node, list):
        for v in node:
            _refs(v, out)
    return out


def _finite(node, known: set[str], root) -> bool:
    """Whether `node` has a finite value, given the `$ref`s already `known` finite (a true over-approximation)."""
    if node is False:
        return False
    if not isinstance(node, dict):
        return True
    ref = node.get("$ref")
    if isinstance(ref, str) and ref not in known and resolve(root, ref) is not UNKNOWN:
        return False
    if isinstance(node.get("allOf"), list) and not all(_finite(s, known, root) for s in node["allOf"]):
        return False
    for key in ("anyOf", "oneOf"):  # one branch that can end is enough
        if isinstance(node.get(key), list) and not any(_finite(s, known, root) for s in node[key]):
            return False
    if "const" in node or "enum" in node:
        return True
    types = node.get("type")
    if isinstance(types, str):
        types = [types]
    if not isinstance(types, list):  # no type: a string or a number will do
        return True
    return any(_type_finite(t, node, known, root) for t in types)


def _type_finite(kind, node: dict, known: set[str], root) -> bool:
    if kind == "object":  # each required property needs a finite value
        props = node.get("properties") if isinstance(node.get("properties"), dict) else {}
        required = node.get("required") if isinstance(node.get("required"), list) else []
        for name in (r for r in required if isinstance(r, str)):  # malformed ones are llguidance's to refuse
            if name in props:
                sub = props[name]
            elif node.get("patternProperties"):
                continue  # which pattern it falls under is llguidance's to tell
            else:
                sub = node.get("additionalProperties", True)
            if not _finite(sub, known, root):
                return False
        return True
    if kind == "array":  # the first minItems items need finite values
        least = node.get("minItems")
        least = least if isinstance(least, int) and not isinstance(least, bool) else 0
        prefix, items = node.get("prefixItems"), node.get("items")
        if isinstance(items, list):  # draft 4-7 tuples
            prefix, items = items, node.get("additionalItems")
        prefix = prefix if isinstance(prefix, list) else []
        if not all(_finite(s, known, root) for s in prefix[:least]):
            return False
        if least > len(prefix) and items is not None and not _finite(items, known, root):
            return False
        contains = node.get("contains")
        return contains is None or node.get("minContains", 1) == 0 or _finite(contains, known, root)
    return True


def unfinishable(schema) -> list[str] | None:
    """None when `schema` admits a finite JSON value (as far as its recursion goes); else the `$ref`s that admit
    none (empty when the schema itself admits no value without any of them)."""
    refs = _refs(schema, set())
    known: set[str] = set()
    grew = True
    while grew:  # least fixpoint: at most one round per $ref
        grew = False
        for ref in sorted(refs - known):
            target = resolve(schema, ref)
            if target is UNKNOWN or _finite(target, known, schema):
                known.add(ref)
                grew = True
    return None if _finite(schema, known, schema) else sorted(refs - known)
