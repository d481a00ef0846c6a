#!/bin/bash
# Oracle for backup-script.
set -euo pipefail
cat > backup.sh <<'EOF'
#!/bin/bash
if [ $# -ne 1 ] || [ ! -d "$1" ]; then
  echo "usage: $0 DIRECTORY" >&2
  exit 1
fi
dir=${1%/}
tar -czf "$(basename "$dir").tar.gz" -C "$(dirname "$dir")" "$(basename "$dir")"
EOF
chmod +x backup.sh
