#!/bin/bash
# Oracle for git-init-commit.
set -euo pipefail
cd project
git init -q
git add -A
git -c user.name=agent -c user.email=agent@example.com commit -q -m 'Initial commit'
