"""Paired accuracy differences (10,000-resample bootstrap, 95%) of selection_oracles.py's draft-accuracy rows
against the grid's `full` and plain query-aware rows on the same questions: python paired.py GRID DRAFT_ROWS"""
import json, random, sys
grid, diag = sys.argv[1], sys.argv[2]
rec = [json.loads(l) for l in open(grid)]
acc = {(r['example_id'], r['mode_key']): r['scores']['accuracy'] for r in rec if 'example_id' in r}
rows = [json.loads(l) for l in open(diag)]
cols = {'full': [], 'q0.15': [], 'q0.3': [], 'draft0.15': [], 'draft0.3': []}
for r in rows:
    e = r['id']
    cols['full'].append(acc[(e, 'full')]); cols['q0.15'].append(acc[(e, 'blend:sel=query,r=0.15')])
    cols['q0.3'].append(acc[(e, 'blend:sel=query,r=0.3')])
    cols['draft0.15'].append(r['draft0.15']['acc']); cols['draft0.3'].append(r['draft0.3']['acc'])
n = len(rows)
def ci(d):
    rng = random.Random(0); m = []
    for _ in range(10000):
        m.append(sum(d[rng.randrange(n)] for _ in range(n)) / n)
    m.sort(); return sum(d) / n * 100, m[250] * 100, m[9749] * 100
print("n", n, "full", sum(cols['full']) / n)
for k in ('q0.15', 'draft0.15', 'q0.3', 'draft0.3'):
    diff = [a - b for a, b in zip(cols[k], cols['full'])]
    print(k, "acc %.3f" % (sum(cols[k]) / n), "minus full %.1f [%.1f, %.1f]" % ci(diff))
for a, b in (('draft0.15', 'q0.15'), ('draft0.3', 'q0.3')):
    print(a, '-', b, "%.1f [%.1f, %.1f]" % ci([x - y for x, y in zip(cols[a], cols[b])]))
