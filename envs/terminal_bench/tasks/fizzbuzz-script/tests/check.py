"""Checks for fizzbuzz-script; exit 0 = pass."""
import subprocess
import sys


def fail(msg):
    print("FAIL:", msg)
    sys.exit(1)


for n, want in ((1, ['1']), (15, ['1', '2', 'Fizz', '4', 'Buzz', 'Fizz', '7', '8', 'Fizz', 'Buzz', '11', 'Fizz', '13', '14', 'FizzBuzz']), (31, ['1', '2', 'Fizz', '4', 'Buzz', 'Fizz', '7', '8', 'Fizz', 'Buzz', '11', 'Fizz', '13', '14', 'FizzBuzz', '16', '17', 'Fizz', '19', 'Buzz', 'Fizz', '22', '23', 'Fizz', 'Buzz', '26', 'Fizz', '28', '29', 'FizzBuzz', '31'])):
    r = subprocess.run(["python3", "fizzbuzz.py", str(n)], capture_output=True, text=True, timeout=10)
    if r.returncode != 0 or r.stdout.split() != want:
        fail(f"N={n}: exit {r.returncode}, {r.stdout[:200]!r} {r.stderr[-300:]!r}")
print("PASS")
