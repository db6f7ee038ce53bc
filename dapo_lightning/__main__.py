from dapo_lightning.cli import main

main()
