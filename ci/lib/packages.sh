# Sourced by the CI scripts: installs the Debian packages named that are not
# installed yet (idempotent; nothing is fetched when all are present).
# Usage: install_missing PACKAGE...
install_missing() {
  local need=() p
  for p in "$@"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || need+=("$p")
  done
  if ((${#need[@]})); then
    printf '\n--- installing %s\n' "${need[*]}"
    DEBIAN_FRONTEND=noninteractive apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
  fi
}
