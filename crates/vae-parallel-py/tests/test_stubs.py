"""The type stubs say what the package has: every public name, and every signature's parameters
(names, kinds, defaults), checked against the extension (`inspect.signature` of its text
signatures) and, for the diffusers drop-in, against its source (parsed: importing it needs torch).
"""

import ast
import inspect
from pathlib import Path

import vae_parallel as vp
from vae_parallel import _native

PACKAGE = Path(vp.__file__).resolve().parent
KINDS = {
    "posonlyargs": inspect.Parameter.POSITIONAL_ONLY,
    "args": inspect.Parameter.POSITIONAL_OR_KEYWORD,
    "kwonlyargs": inspect.Parameter.KEYWORD_ONLY,
}


def parse(name: str) -> ast.Module:
    return ast.parse((PACKAGE / name).read_text())


def default_of(node):
    """A default as a value (`...` for one no literal can write)."""
    try:
        return ast.literal_eval(node)
    except ValueError:
        return ...


def ast_params(fn: ast.FunctionDef, skip_first: bool) -> list:
    """`(name, kind, default)` per parameter, as `inspect.Parameter` would name them."""
    a = fn.args
    positional = [(p, KINDS["posonlyargs"]) for p in a.posonlyargs] + [(p, KINDS["args"]) for p in a.args]
    defaults = [inspect.Parameter.empty] * (len(positional) - len(a.defaults)) + [default_of(d) for d in a.defaults]
    params = [(p.arg, kind, d) for (p, kind), d in zip(positional, defaults)]
    if a.vararg:
        params.append((a.vararg.arg, inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.empty))
    for p, d in zip(a.kwonlyargs, a.kw_defaults):
        params.append((p.arg, KINDS["kwonlyargs"], inspect.Parameter.empty if d is None else default_of(d)))
    if a.kwarg:
        params.append((a.kwarg.arg, inspect.Parameter.VAR_KEYWORD, inspect.Parameter.empty))
    return params[1:] if skip_first else params


def runtime_params(fn, skip_first: bool) -> list:
    params = list(inspect.signature(fn).parameters.values())
    params = params[1:] if skip_first else params
    # The extension's text signatures write a default no literal can (a Rust constant) as `...`;
    # the stub then has to write its value, which the stub's own tests of behaviour cover.
    return [(p.name, p.kind, p.default) for p in params]


def same(stub: list, runtime: list) -> bool:
    if [(n, k) for n, k, _ in stub] != [(n, k) for n, k, _ in runtime]:
        return False
    return all(r is ... or s == r for (_, _, s), (_, _, r) in zip(stub, runtime))


def public(names) -> set:
    return {n for n in names if not n.startswith("_")}


def defs(body) -> dict:
    """The functions of a module or class body by name (overloads: the first)."""
    out = {}
    for node in body:
        if isinstance(node, ast.FunctionDef):
            out.setdefault(node.name, node)
    return out


def test_the_extensions_stub_has_every_public_name_and_signature():
    stub = parse("_native.pyi")
    functions = defs(stub.body)
    classes = {n.name: n for n in stub.body if isinstance(n, ast.ClassDef)}
    assigned = {t.target.id for t in stub.body if isinstance(t, ast.AnnAssign)}
    assert public(dir(_native)) == public(functions) | public(classes) | public(assigned - {"_F32", "_PathLike"})
    assert "__version__" in assigned
    for name in public(functions):
        assert same(ast_params(functions[name], False), runtime_params(getattr(_native, name), False)), name
    methods = defs(classes["Vae"].body)
    runtime_methods = public(n for n in dir(_native.Vae))
    assert public(methods) == runtime_methods
    for name in runtime_methods:
        attr = inspect.getattr_static(_native.Vae, name)
        if callable(attr):
            assert same(ast_params(methods[name], True), runtime_params(getattr(_native.Vae, name), True)), name
        else:
            assert any(isinstance(d, ast.Name) and d.id == "property" for d in methods[name].decorator_list), name
    # Every exception, with its base.
    for name, node in classes.items():
        if name.endswith("Error"):
            base = getattr(_native, name).__bases__[0].__name__
            assert [b.id for b in node.bases] == [base], name


def test_the_diffusers_stub_matches_its_source():
    stub, source = parse("diffusers.pyi"), parse("diffusers.py")

    def top_names(module):
        names = set(defs(module.body)) | {n.name for n in module.body if isinstance(n, ast.ClassDef)}
        for node in module.body:
            if isinstance(node, ast.Assign):
                names |= {t.id for t in node.targets if isinstance(t, ast.Name)}
            elif isinstance(node, ast.AnnAssign):
                names.add(node.target.id)
        return public(names)

    assert top_names(stub) == top_names(source)
    cls = {m: next(n for n in m.body if isinstance(n, ast.ClassDef) and n.name == "DistributedVae")
           for m in (stub, source)}
    stub_methods, source_methods = defs(cls[stub].body), defs(cls[source].body)
    assert public(stub_methods) == public(source_methods)
    for name in public(source_methods) | {"__init__"}:
        first_is_self = not any(isinstance(d, ast.Name) and d.id == "staticmethod"
                                for d in source_methods[name].decorator_list)
        assert ast_params(stub_methods[name], first_is_self) == ast_params(source_methods[name], first_is_self), name
    # `__call__ = forward` in the source: the stub's __call__ is forward's.
    assert ast_params(stub_methods["__call__"], True) == ast_params(source_methods["forward"], True)
