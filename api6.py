from moeprefetch import MoEPrefetchEngine
P = "/work/main/moeprefetch/reference_model"
e = MoEPrefetchEngine.from_pretrained(P, progress=False)
r = e.generate(["Hello world"], max_new_tokens=4, speculative="auto", presence_penalty=0.5); print("auto+pen ok", r.sequences)
r = e.generate(["Hello world"], max_new_tokens=4, logprobs=2, speculative="mtp"); print("lp+spec", r.sequences, r.logprobs[0][0])
def cb(ev):
    try: e.generate(["x"], max_new_tokens=1)
    except Exception as ex: print("reentrant:", type(ex).__name__, ex); raise SystemExit
try: e.generate(["Hello world"], max_new_tokens=3, callback=cb)
except SystemExit: pass
print("after reentrant", e.generate(["Hello world"], max_new_tokens=4).sequences)
def cb2(ev): raise KeyboardInterrupt
r = e.generate(["Hello world"], max_new_tokens=6, callback=cb2); print("kbint", r.interrupted, r.sequences)
print("after kbint", e.generate(["Hello world"], max_new_tokens=4).sequences)
r = e.generate([[1]], max_new_tokens=5, stop_at_eos=True); print("eos prompt", r.sequences)
r = e.generate("Hello world", max_new_tokens=2000); print("long", len(r.sequences[0]))
