#!/bin/bash
# Verifier: writes 1 to /logs/verifier/reward.txt when only the .tmp files under cache/ are gone, else 0.
mkdir -p /logs/verifier
if python3 /tests/check.py; then
  echo 1 > /logs/verifier/reward.txt
else
  echo 0 > /logs/verifier/reward.txt
fi
