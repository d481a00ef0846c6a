#!/bin/bash
# Verifier: writes 1 to /logs/verifier/reward.txt when log.txt is its three lines followed by done, else 0.
mkdir -p /logs/verifier
if python3 /tests/check.py; then
  echo 1 > /logs/verifier/reward.txt
else
  echo 0 > /logs/verifier/reward.txt
fi
