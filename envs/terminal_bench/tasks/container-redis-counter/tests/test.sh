#!/bin/bash
# Verifier: writes 1 to /logs/verifier/reward.txt when redis holds visits=42 and /app/visits.txt says 42, else 0.
mkdir -p /logs/verifier
if [ "$(redis-cli get visits 2>/dev/null)" = "42" ] && [ "$(tr -d " \n" < /app/visits.txt)" = "42" ]; then
  echo 1 > /logs/verifier/reward.txt
else
  echo 0 > /logs/verifier/reward.txt
fi
