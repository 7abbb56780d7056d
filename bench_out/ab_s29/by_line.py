"""Join a profile's per-op times (/tmp/prof_ops.json from prof.py) with the compiled HLO's source lines; print ms per line."""
import collections, json, re, sys
ops = json.load(open(sys.argv[1])); hlo = open(sys.argv[2]).read()
frames = {}; locs = {}; files = {}
for m in re.finditer(r"^(\d+) \{file_location_id=(\d+) parent_frame_id=(\d+)\}", hlo, re.M): frames[m[1]] = (m[2], m[3])
for m in re.finditer(r"^(\d+) \{file_name_id=(\d+) function_name_id=\d+ line=(\d+)", hlo, re.M): locs[m[1]] = (m[2], m[3])
for m in re.finditer(r'^(\d+) "(.*)"$', hlo, re.M): files.setdefault(m[1], m[2])
def where(fid, depth=30):
    out = []
    while fid in frames and len(out) < depth:
        loc, parent = frames[fid]; fn, line = locs[loc]; out.append(f"{files.get(fn,'?').split('/')[-1]}:{line}")
        if parent == fid: break
        fid = parent
    return out
agg = collections.Counter(); kinds = collections.defaultdict(set)
comp = {}  # fusion computation name -> its instructions' frame ids
for name, ms in ops.items():
    m = re.search(r"^\s*(?:ROOT )?%" + re.escape(name) + r" = .*$", hlo, re.M)
    if not m: continue
    line = m[0]
    fm = re.search(r"stack_frame_id=(\d+)", line)
    calls = re.search(r"calls=%([\w.\-]+)", line)
    if calls and not fm:
        body = re.search(r"^%" + re.escape(calls[1]) + r" .*?^\}", hlo, re.M | re.S)
        fm = body and re.search(r"stack_frame_id=(\d+)", body[0].split("ROOT")[-1])
    key = " <- ".join([w for w in where(fm[1]) if "eva.py" in w or "peer" in w][:2]) if fm else "?"
    agg[key or "other"] += ms; kinds[key or "other"].add(re.sub(r"\.\d+$", "", name))
for k, ms in agg.most_common(int(sys.argv[3]) if len(sys.argv) > 3 else 40):
    print(f"{ms:7.2f} ms  {k[:90]:90s} {sorted(kinds[k])[:3]}")
