#!/usr/bin/env bash
# The new-user walk of issue 29 (README + docs/train.md "A first run on CPU"), each step timed.
set -u
W=${W:-/tmp/walk}; rm -rf $W; git clone -q /work/main $W; cd $W
t() { local s=$SECONDS; echo "### $*"; "$@"; local rc=$?; echo "### rc=$rc wall=$((SECONDS-s)) s: $*"; }
t bash -c "python3 -m venv .venv && .venv/bin/pip install -q torch==2.13.0 -e '.[train,dev]'"
source .venv/bin/activate
t kernelguard check --model qwen3_5 --mode training --arch 9.0 > check.out 2>&1; tail -3 check.out
t python -m kernelguard.train.tiktoken_folder --qwen3.5 tok
t python bench/quality/chitchat_to_jsonl.py --out chitchat.jsonl --limit 2000
t python -c "from transformers import Qwen3_5TextConfig as C; C(vocab_size=248320, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, tie_word_embeddings=True).save_pretrained('tiny')"
ARGS=(--model tiny/config.json --tokenizer tok --data chitchat.jsonl --output-dir run --max-length 256 --max-steps 12 --save-steps 3 --packing none --allow causal_conv1d_fn chunk_gated_delta_rule)
echo "### train, then Ctrl-C once step 6's checkpoint exists"
s=$SECONDS
python - "${ARGS[@]}" <<'PY'
import os, signal, subprocess, sys, time, glob
p = subprocess.Popen(["kernelguard", "train", *sys.argv[1:]], start_new_session=True, stderr=subprocess.PIPE, text=True,
                     preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
while not [d for d in glob.glob("run/checkpoints/*6*") if not d.endswith(".tmp")]:
    if p.poll() is not None: break
    time.sleep(0.2)
time.sleep(1.0)
os.killpg(p.pid, signal.SIGINT)
_, err = p.communicate(timeout=300)
print(err[-1500:]); print("rc", p.returncode)
PY
echo "### rc above; wall=$((SECONDS-s)) s (train until step 6 + Ctrl-C)"
t kernelguard train "${ARGS[@]}" --resume > resume.err 2>&1; tail -4 resume.err
t python -c "from transformers import AutoModelForCausalLM as M, AutoTokenizer as T; t = T.from_pretrained('run/final'); m = M.from_pretrained('run/final'); x = t.apply_chat_template([{'role': 'user', 'content': 'Hi! How are you?'}], add_generation_prompt=True, return_dict=True, return_tensors='pt'); print(t.decode(m.generate(**x, max_new_tokens=20)[0]))"
ls run/checkpoints
t kernelguard export run/checkpoints/$(ls run/checkpoints | grep -v tmp | sort | tail -1) --output exported
t python -c "from transformers import AutoModelForCausalLM as M, AutoTokenizer as T; t = T.from_pretrained('exported'); m = M.from_pretrained('exported'); x = t.apply_chat_template([{'role': 'user', 'content': 'Hi!'}], add_generation_prompt=True, return_dict=True, return_tensors='pt'); print(t.decode(m.generate(**x, max_new_tokens=10)[0]))"
echo "### refusals that must come before the stack check and the model build (< 5 s)"
mkdir -p tikonly && cp tok/*.tiktoken tikonly/ 2>/dev/null; ls tikonly
echo '{"text": 5}' > bad.jsonl
t kernelguard train --model tiny/config.json --tokenizer tikonly --data chitchat.jsonl --output-dir r1 --packing none --allow causal_conv1d_fn chunk_gated_delta_rule
t kernelguard train --model tiny/config.json --tokenizer tok --data bad.jsonl --output-dir r2 --packing none --allow causal_conv1d_fn chunk_gated_delta_rule
t kernelguard train --model tiny/config.json --tokenizer tok --data chitchat.jsonl --chat-template nosuch --output-dir r3 --packing none --allow causal_conv1d_fn chunk_gated_delta_rule
ls -d r1 r2 r3 2>&1
