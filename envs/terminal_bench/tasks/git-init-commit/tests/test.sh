#!/bin/bash
# Verifier: writes 1 to /logs/verifier/reward.txt when project/ is a git repo with one 'Initial commit' holding all files, else 0.
mkdir -p /logs/verifier
if python3 /tests/check.py; then
  echo 1 > /logs/verifier/reward.txt
else
  echo 0 > /logs/verifier/reward.txt
fi
