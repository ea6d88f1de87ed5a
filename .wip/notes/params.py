"""Functions with more than 10 parameters (self/cls not counted) under engines/, pipelines/, recipes/ of a tree."""
import ast, os, sys
root = sys.argv[1] if len(sys.argv) > 1 else "."
hits = []
for top in ("engines", "pipelines", "recipes"):
    for d, _, files in os.walk(os.path.join(root, top)):
        for f in files:
            if f.endswith(".py"):
                p = os.path.join(d, f)
                for n in ast.walk(ast.parse(open(p, encoding="utf-8").read())):
                    if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)):
                        a = n.args
                        k = len(a.posonlyargs) + len(a.args) + len(a.kwonlyargs) - int(bool(a.args) and a.args[0].arg in ("self", "cls"))
                        if k > 10:
                            hits.append(f"{os.path.relpath(p, root)}:{n.lineno} {n.name} ({k})")
print(len(hits)); print("\n".join(hits))
