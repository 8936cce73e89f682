# Source at the start of a device command (from the project root, `.whl` and `.jit` carried):
#   source benchmarks/gpu_env.sh && python3 ...
# Installs the carried wheels (FlashInfer, Diffusers), restores FlashInfer kernels built by an
# earlier call from `.jit/*.tar.xz` into FlashInfer's AOT folder, and on exit packs every module
# built by JIT in this call into "$OUT/<module>.tar.xz" (carry them back in `.jit/` next time);
# call `save_jit` right after a build too, so a command cut short still returns it.
source .whl/setup.sh
export PYTHONUNBUFFERED=1
_aot=/tmp/site/flashinfer/data/aot
mkdir -p "$_aot"
for _a in .jit/*.tar.xz; do  # a damaged archive leaves nothing behind, so the kernel is built (and saved) again
  [ -f "$_a" ] && { tar xJf "$_a" -C "$_aot" || { echo "damaged JIT archive $_a"; rm -rf "$_aot/$(basename "$_a" .tar.xz)"; }; }
done
save_jit() {
  local so uri
  for so in $(find "$FLASHINFER_WORKSPACE_BASE" -path '*cached_ops*' -name '*.so' 2>/dev/null); do
    uri=$(basename "$so" .so)
    [ -f "$_aot/$uri/$uri.so" ] || [ -f "${OUT:-/tmp}/$uri.tar.xz" ] && continue
    mkdir -p "/tmp/jitpack/$uri" && cp "$so" "/tmp/jitpack/$uri/"
    XZ_OPT=-T0 tar cJf "${OUT:-/tmp}/$uri.tar.xz" -C /tmp/jitpack "$uri" && echo "saved JIT module $uri ($(du -h "${OUT:-/tmp}/$uri.tar.xz" | cut -f1))"
  done
}
trap save_jit EXIT
