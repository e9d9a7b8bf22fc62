from streamrl.cli import console

console()
