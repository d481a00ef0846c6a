#!/bin/bash
# Verifier: writes 1 to /logs/verifier/reward.txt when count.txt holds 37, else 0.
mkdir -p /logs/verifier
if [ -f count.txt ] && [ "$(tr -d " \t\n" < count.txt)" = "37" ]; then
  echo 1 > /logs/verifier/reward.txt
else
  echo 0 > /logs/verifier/reward.txt
fi
