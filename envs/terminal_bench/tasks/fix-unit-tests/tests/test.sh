#!/bin/bash
# Verifier: writes 1 to /logs/verifier/reward.txt when calc.py passes the hidden unit tests, else 0.
mkdir -p /logs/verifier
if python3 /tests/test_hidden.py; then
  echo 1 > /logs/verifier/reward.txt
else
  echo 0 > /logs/verifier/reward.txt
fi
