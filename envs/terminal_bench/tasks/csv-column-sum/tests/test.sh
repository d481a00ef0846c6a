#!/bin/bash
# Verifier: writes 1 to /logs/verifier/reward.txt when total.txt holds the column sum with two decimals, else 0.
mkdir -p /logs/verifier
if [ -f total.txt ] && [ "$(tr -d " \t\n" < total.txt)" = "1954.03" ]; then
  echo 1 > /logs/verifier/reward.txt
else
  echo 0 > /logs/verifier/reward.txt
fi
